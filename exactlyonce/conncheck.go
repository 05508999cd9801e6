package exactlyonce

import (
	"context"
	"errors"
	"sync"
	"time"

	"github.com/exactlyonce/watermill-exactlyonce/internal/pgerr"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// connCheck runs sqlschema.CheckConn once, before the first claim: on
// MySQL a DSN with clientFoundRows=true would make a claim take an existing
// record for a new one, and a DSN without parseTime=true fails every scan
// of a time. Until it got an answer, each claim asks it first; once it
// answered, its verdict stands (a refused connection refuses every claim:
// a configuration error, never fixed by a redelivery).
type connCheck struct {
	mu   sync.Mutex
	done bool
	err  error
}

// connCheckTimeout bounds the check.
const connCheckTimeout = 10 * time.Second

// check returns the verdict, asking the database when it has none yet. An
// unreachable database is no verdict: nil, and the claim meets the outage.
func (c *connCheck) check(ctx context.Context, db sqlschema.DB) error {
	if db.Dialect != sqlschema.MySQL {
		return nil
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.done {
		return c.err
	}
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), connCheckTimeout)
	defer cancel()
	err := sqlschema.CheckConn(cctx, db)
	if err != nil && !errors.Is(err, sqlschema.ErrEngine) && (pgerr.Unreachable(err) || cctx.Err() != nil) {
		return nil
	}
	c.done, c.err = true, err
	return err
}
