package outbox

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/exactlyonce/watermill-exactlyonce/internal/outboxnotify"
)

// errNoListen says why the relay cannot LISTEN at all with this
// configuration: it polls, and does not try again.
type errNoListen struct{ reason string }

func (e errNoListen) Error() string { return e.reason }

// listen keeps a LISTEN connection open on the outbox table's channel while
// ctx lasts, turning each notification (any number of them) into one
// pending wake of the workers. When the connection is lost it says so once,
// reconnects with backoff, and wakes the workers when it is back (rows may
// have committed meanwhile). When LISTEN cannot work with this
// configuration (no pgx connection to listen on, or one through a
// connection pooler), it logs why once and returns: the workers poll.
func (r *Relay) listen(ctx context.Context) {
	backoff := r.cfg.ErrorBackoff
	lost, first := false, true
	for ctx.Err() == nil {
		err := r.listenOnce(ctx, func() {
			backoff = r.cfg.ErrorBackoff
			if first {
				r.cfg.Logger.Info("outbox relay: wake-on-commit is on (LISTEN); polling every "+r.cfg.PollInterval.String()+" as the fallback",
					watermill.LogFields{"channel": r.channel})
				first = false
			}
			if lost {
				r.cfg.Logger.Info("outbox relay: wake-on-commit is back (LISTEN)", watermill.LogFields{"channel": r.channel})
				lost = false
			}
		})
		r.listening.Store(false)
		if ctx.Err() != nil {
			return
		}
		var no errNoListen
		if errors.As(err, &no) {
			r.cfg.Logger.Info("outbox relay: wake-on-commit is off, polling every "+r.cfg.PollInterval.String()+": "+no.reason, nil)
			return
		}
		if !lost {
			r.cfg.Logger.Error("outbox relay: the LISTEN connection failed; polling every "+r.cfg.PollInterval.String()+" until it is back", err,
				watermill.LogFields{"retry_in": backoff.String()})
			lost = true
		}
		r.wakeWorkers()
		t := time.NewTimer(backoff)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
		backoff = min(2*backoff, r.cfg.MaxErrorBackoff)
	}
}

// wakeInProcess is listen on MySQL/MariaDB, which has no LISTEN/NOTIFY:
// it says once that the relay polls, and turns the in-process signals of
// the table's writers (WakeRelays) into wakes of the workers until ctx
// ends. Rows committed by other processes wait for the next poll.
func (r *Relay) wakeInProcess(ctx context.Context) {
	wake, cancel := outboxnotify.Subscribe(r.cfg.DB)
	defer cancel()
	r.cfg.Logger.Info("outbox relay: wake-on-commit (LISTEN/NOTIFY) is not available on MySQL: polling every "+r.cfg.PollInterval.String()+
		"; rows committed by writers of this process wake the relay at once, those of other processes are seen at the next poll", nil)
	for {
		select {
		case <-ctx.Done():
			return
		case <-wake:
			r.wakeWorkers()
		}
	}
}

// wakeWorkers makes one waiting (or the next) worker poll now. Wakes do not
// accumulate: one pending wake stands for any number of notifications.
func (r *Relay) wakeWorkers() {
	select {
	case r.wake <- struct{}{}:
	default:
	}
}

// listenOnce opens the LISTEN connection, calls up once it listens, and
// relays notifications until the connection fails or ctx ends.
func (r *Relay) listenOnce(ctx context.Context, up func()) error {
	return r.withListenConn(ctx, func(conn *pgx.Conn) error {
		// A pooler in transaction mode (PgBouncer) hands the client's
		// statements to any server connection: a LISTEN would stay on one
		// of them, and its notifications would reach whichever client uses
		// it next, or nobody. A pooler shows itself by the backend key it
		// invents: the process id the client was given at startup is not
		// the server's.
		pid, err := r.store.BackendPID(ctx, conn)
		if err != nil {
			return fmt.Errorf("reading the backend pid: %w", err)
		}
		if pid != conn.PgConn().PID() {
			return errNoListen{"the relay's connection goes through a connection pooler (PgBouncer?), where LISTEN does not hold; " +
				"set RelayConfig.ListenConnString to a direct PostgreSQL address to wake on commit"}
		}
		if err := r.store.Listen(ctx, conn); err != nil {
			return fmt.Errorf("LISTEN: %w", err)
		}
		// The session shows what it is by a lock it holds for as long as
		// it lasts (the console lists the relays by it), whatever its
		// last statement was; a table not there yet is tried again after
		// each notification or ping.
		marked, err := r.markListener(ctx, conn)
		if err != nil {
			return err
		}
		r.listening.Store(true)
		up()
		// Rows committed before the LISTEN took effect sent their NOTIFY to
		// nobody: look once.
		r.wakeWorkers()
		for {
			// A connection that died without a word (a half-open TCP
			// connection: a failover, a NAT dropping it) would leave the
			// relay believing it listens until TCP keepalive noticed,
			// minutes later. So it pings the server after each
			// r.listenPing without a notification, and takes the
			// connection for dead when the ping takes longer than
			// r.listenPingTimeout.
			waitCtx, cancel := context.WithTimeout(ctx, r.listenPing)
			_, err := conn.WaitForNotification(waitCtx)
			cancel()
			switch {
			case err != nil && ctx.Err() == nil && pgconn.Timeout(err):
				pingCtx, cancel := context.WithTimeout(ctx, r.listenPingTimeout)
				err = conn.Ping(pingCtx)
				cancel()
				if err != nil {
					return fmt.Errorf("the LISTEN connection did not answer a ping within %s: %w", r.listenPingTimeout, err)
				}
			case err != nil:
				return err
			default:
				r.wakeWorkers()
			}
			if !marked {
				if marked, err = r.markListener(ctx, conn); err != nil {
					return err
				}
			}
		}
	})
}

// markListener takes, in conn's session, the shared advisory lock of the
// outbox table that marks a relay's LISTEN session (internal/outboxdb's
// LockListener). It reports false when the table does not exist (in this
// database: see RelayConfig.ListenConnString).
func (r *Relay) markListener(ctx context.Context, conn *pgx.Conn) (bool, error) {
	held, err := r.store.LockListener(ctx, conn)
	if err != nil {
		return false, fmt.Errorf("taking the lock that marks the LISTEN session: %w", err)
	}
	return held, nil
}

// withListenConn runs f on a connection of its own: a new one to
// RelayConfig.ListenConnString if set; else one taken out of DB.Conn's pgx
// pool (it is not returned; the pool opens another when it needs one); else,
// for a database/sql DB on the pgx driver (pgx/v5/stdlib), a new connection
// with the configuration of the pool's (outside the pool: it does not count
// against SetMaxOpenConns). Other drivers cannot LISTEN here.
func (r *Relay) withListenConn(ctx context.Context, f func(*pgx.Conn) error) error {
	connectCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if r.cfg.ListenConnString != "" {
		conn, err := pgx.Connect(connectCtx, r.cfg.ListenConnString)
		if err != nil {
			return fmt.Errorf("connecting to RelayConfig.ListenConnString: %w", err)
		}
		defer closeConn(conn)
		return f(conn)
	}
	if pool, ok := r.conn.PgxPool(); ok {
		pc, err := pool.Acquire(connectCtx)
		if err != nil {
			return fmt.Errorf("taking a connection from the pool: %w", err)
		}
		conn := pc.Hijack()
		defer closeConn(conn)
		return f(conn)
	}
	if db, ok := r.conn.StdDB(); ok {
		// Not one of the pool's connections: held for as long as Run
		// lasts, it would count against SetMaxOpenConns for good (with
		// one open connection per worker, the batches would wait for it
		// forever). A pooled connection only lends its configuration.
		c, err := db.Conn(connectCtx)
		if err != nil {
			return fmt.Errorf("taking a connection from the database/sql pool: %w", err)
		}
		var cfg *pgx.ConnConfig
		rawErr := c.Raw(func(driverConn any) error {
			pc, ok := driverConn.(interface{ Conn() *pgx.Conn })
			if !ok {
				return errNoListen{fmt.Sprintf("the database/sql driver (%T) is not pgx's stdlib; "+
					"set RelayConfig.ListenConnString to wake on commit", driverConn)}
			}
			cfg = pc.Conn().Config()
			return nil
		})
		_ = c.Close()
		if rawErr != nil {
			return rawErr
		}
		// The copy carries the pooled connection's own notification
		// handler (pgx installs one only where there is none): left
		// there, this connection's notifications would pile up in that
		// pooled connection, unread for good and written by every relay
		// of the pool at once (a data race).
		cfg.OnNotification = nil
		conn, err := pgx.ConnectConfig(connectCtx, cfg)
		if err != nil {
			return fmt.Errorf("connecting with the database/sql pool's configuration: %w", err)
		}
		defer closeConn(conn)
		return f(conn)
	}
	return errNoListen{fmt.Sprintf("DB.Conn (%T) is neither a pgx pool nor a database/sql DB; "+
		"set RelayConfig.ListenConnString to wake on commit", r.cfg.DB.Conn)}
}

func closeConn(conn *pgx.Conn) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_ = conn.Close(ctx)
}
