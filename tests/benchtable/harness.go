package main

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"fmt"
	"os"
	"path/filepath"
	"runtime/pprof"
	"strconv"
	"strings"
	"time"

	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// harness holds what the sections share: the connections, the names of
// everything this run created (dropped by cleanup), and the CPU accounts.
type harness struct {
	cfg    *config
	id     string // random suffix of every schema and queue of this run
	admin  *pgxpool.Pool
	amqp   *amqp.Connection
	ch     *amqp.Channel
	schema []string // created schemas
	queues []string // declared queues

	myAdmin   *sql.DB  // MariaDB, when -engines has it
	databases []string // created MariaDB databases

	cpu     []*cpuAccount
	cpuByID map[string]*cpuAccount
	profile map[string]bool // variants already profiled
	seq     int             // numbers schemas and queues made per round

	stmts     []*stmtAccount // -stmts
	stmtsByID map[string]*stmtAccount
}

func newHarness(ctx context.Context, cfg *config) (*harness, error) {
	b := make([]byte, 4)
	_, _ = rand.Read(b)
	h := &harness{cfg: cfg, id: hex.EncodeToString(b), cpuByID: map[string]*cpuAccount{}, profile: map[string]bool{}, stmtsByID: map[string]*stmtAccount{}}
	pool, err := newPool(ctx, cfg.dbURL, 4, "")
	if err != nil {
		return nil, err
	}
	h.admin = pool
	if cfg.hasEngine(mariadb) && (cfg.only["router"] || cfg.only["relay"] || cfg.only["retention"]) {
		if h.myAdmin, err = openMySQL(ctx, cfg.mysqlURL, 4, nil); err != nil {
			pool.Close()
			return nil, err
		}
	}
	if h.amqp, err = amqp.Dial(cfg.amqpURL); err != nil {
		pool.Close()
		if h.myAdmin != nil {
			_ = h.myAdmin.Close()
		}
		return nil, fmt.Errorf("RabbitMQ at %s: %w", cfg.amqpURL, err)
	}
	if h.ch, err = h.amqp.Channel(); err != nil {
		h.cleanup()
		return nil, err
	}
	if cfg.profDir != "" {
		if err := os.MkdirAll(cfg.profDir, 0o755); err != nil {
			h.cleanup()
			return nil, err
		}
	}
	return h, nil
}

// newPool is a pgx pool of maxConns connections; searchPath, when set, is
// the sessions' search_path (watermill-sql's default schema names its
// tables without a schema).
func newPool(ctx context.Context, dbURL string, maxConns int, searchPath string) (*pgxpool.Pool, error) {
	return newPoolTraced(ctx, dbURL, maxConns, searchPath, nil)
}

// newPoolTraced is newPool whose statements trace counts (-stmts) when
// not nil.
func newPoolTraced(ctx context.Context, dbURL string, maxConns int, searchPath string, trace *stmtTrace) (*pgxpool.Pool, error) {
	pc, err := pgxpool.ParseConfig(dbURL)
	if err != nil {
		return nil, err
	}
	pc.MaxConns = int32(maxConns)
	if trace != nil {
		pc.ConnConfig.Tracer = pgxTracer{t: trace}
	}
	if searchPath != "" {
		pc.ConnConfig.RuntimeParams["search_path"] = searchPath
	}
	pool, err := pgxpool.NewWithConfig(ctx, pc)
	if err != nil {
		return nil, err
	}
	if err := pool.Ping(ctx); err != nil {
		pool.Close()
		return nil, fmt.Errorf("PostgreSQL at %s: %w (make services)", dbURL, err)
	}
	return pool, nil
}

// cleanup drops the schemas and deletes the queues this run created.
func (h *harness) cleanup() {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if h.ch != nil {
		for _, q := range h.queues {
			if _, err := h.ch.QueueDelete(q, false, false, false); err != nil {
				logf("deleting queue %s: %v", q, err)
				if h.ch, err = h.amqp.Channel(); err != nil {
					break
				}
			}
		}
	}
	if h.amqp != nil {
		_ = h.amqp.Close()
	}
	if h.admin != nil {
		for _, s := range h.schema {
			if _, err := h.admin.Exec(ctx, "DROP SCHEMA "+pgx.Identifier{s}.Sanitize()+" CASCADE"); err != nil {
				logf("dropping schema %s: %v", s, err)
			}
		}
		h.admin.Close()
	}
	if h.myAdmin != nil {
		for _, d := range h.databases {
			q := mustSQL(mariadb, "DropDatabase", sqlData{Database: sqlschema.MySQL.QuoteIdentifier(d)})
			if _, err := h.myAdmin.ExecContext(ctx, q); err != nil {
				logf("dropping database %s: %v", d, err)
			}
		}
		_ = h.myAdmin.Close()
	}
}

// newSchema creates a schema with the library's tables (sqlschema.Migrate).
func (h *harness) newSchema(ctx context.Context, name string) (sqlschema.DB, error) {
	s := strings.ToLower("benchtable_" + name + "_" + h.id) // unquoted in a search_path
	h.schema = append(h.schema, s)
	db := sqlschema.DB{Conn: wsql.BeginnerFromPgx(h.admin), Schema: s}
	if err := sqlschema.Migrate(ctx, db); err != nil {
		return db, err
	}
	return db.WithDefaults(), nil
}

// newSchemaWith is newSchema with db's table names and layout.
func (h *harness) newSchemaWith(ctx context.Context, name string, db sqlschema.DB) (sqlschema.DB, error) {
	s := strings.ToLower("benchtable_" + name + "_" + h.id)
	h.schema = append(h.schema, s)
	db.Conn = wsql.BeginnerFromPgx(h.admin)
	db.Schema = s
	if err := sqlschema.Migrate(ctx, db); err != nil {
		return db, err
	}
	return db.WithDefaults(), nil
}

// newQueue declares a durable queue (watermill-amqp's NewDurableQueueConfig
// properties) deleted by cleanup.
func (h *harness) newQueue(name string) (string, error) {
	q := "benchtable_" + name + "_" + h.id
	if _, err := h.ch.QueueDeclare(q, true, false, false, false, nil); err != nil {
		return "", err
	}
	h.queues = append(h.queues, q)
	return q, nil
}

func (h *harness) purge(q string) error {
	_, err := h.ch.QueuePurge(q, false)
	return err
}

// depth is the number of ready messages in q.
func (h *harness) depth(q string) (int, error) {
	st, err := h.ch.QueueDeclarePassive(q, true, false, false, false, nil)
	return st.Messages, err
}

const prefillWindow = 512

var benchPayload = []byte(`{"order":"bench","amount":4200,"currency":"EUR"}`)

// publishN publishes n persistent messages to q through the default
// exchange, with Watermill's UUID header (prefix + sequence number), keeping
// prefillWindow publisher confirms outstanding. It is how the router
// section's queues are pre-filled, outside the timing.
func publishN(ctx context.Context, conn *amqp.Connection, q, prefix string, from, n int) error {
	ch, err := conn.Channel()
	if err != nil {
		return err
	}
	defer func() { _ = ch.Close() }()
	if err := ch.Confirm(false); err != nil {
		return err
	}
	window := make(chan *amqp.DeferredConfirmation, prefillWindow)
	await := func(dc *amqp.DeferredConfirmation) error {
		ok, err := dc.WaitContext(ctx)
		if err != nil {
			return err
		}
		if !ok {
			return fmt.Errorf("RabbitMQ nacked a pre-fill message of %s", q)
		}
		return nil
	}
	for i := from; i < from+n; i++ {
		if len(window) == cap(window) {
			if err := await(<-window); err != nil {
				return err
			}
		}
		dc, err := ch.PublishWithDeferredConfirmWithContext(ctx, "", q, true, false, amqp.Publishing{
			Headers:      amqp.Table{wamqp.DefaultMessageUUIDHeaderKey: prefix + strconv.Itoa(i)},
			DeliveryMode: amqp.Persistent,
			Body:         benchPayload,
		})
		if err != nil {
			return err
		}
		window <- dc
	}
	for len(window) > 0 {
		if err := await(<-window); err != nil {
			return err
		}
	}
	return nil
}

// publishParallel is publishN split over 4 channels publishing at once
// (large pre-fills).
func publishParallel(ctx context.Context, conn *amqp.Connection, q, prefix string, from, n int) error {
	const parts = 4
	errs := make(chan error, parts)
	for i := range parts {
		lo, hi := from+n*i/parts, from+n*(i+1)/parts
		go func() { errs <- publishN(ctx, conn, q, prefix, lo, hi-lo) }()
	}
	var first error
	for range parts {
		if err := <-errs; err != nil && first == nil {
			first = err
		}
	}
	return first
}

// timed runs f as the timed section of variant id: it accounts the CPU of
// the machine, of this process, of PostgreSQL and of RabbitMQ during f, and
// profiles this process during the first timed section of each variant when
// -cpuprofile is set. f returns how many items (messages, events) it timed.
func (h *harness) timed(id string, f func() (int, time.Duration, error)) error {
	stopProf := func() {}
	if h.cfg.profDir != "" && !h.profile[id] {
		h.profile[id] = true
		path := filepath.Join(h.cfg.profDir, sanitize(id)+".pprof")
		if fh, err := os.Create(path); err == nil {
			if err := pprof.StartCPUProfile(fh); err == nil {
				stopProf = func() { pprof.StopCPUProfile(); _ = fh.Close() }
			} else {
				_ = fh.Close()
			}
		}
	}
	before := readCPU()
	n, wall, err := f()
	after := readCPU()
	stopProf()
	if err != nil {
		return err
	}
	acc := h.cpuByID[id]
	if acc == nil {
		acc = &cpuAccount{id: id}
		h.cpuByID[id] = acc
		h.cpu = append(h.cpu, acc)
	}
	acc.add(before, after, n, wall)
	return nil
}

func sanitize(s string) string {
	b := []byte(s)
	for i, c := range b {
		switch {
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9', c == '-':
		default:
			b[i] = '_'
		}
	}
	return string(b)
}

// exec runs SQL on the admin pool.
func (h *harness) exec(ctx context.Context, sql string, args ...any) error {
	_, err := h.admin.Exec(ctx, sql, args...)
	return err
}

func (h *harness) count(ctx context.Context, sql string, args ...any) (int64, error) {
	var n int64
	err := h.admin.QueryRow(ctx, sql, args...).Scan(&n)
	return n, err
}
