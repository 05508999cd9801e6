package exactlyonce_test

// The inbox's duplicate count (inbox.Store.Stats, `exactlyonce inbox
// stats`, the console's "Duplicates dropped") must equal the duplicates
// the middleware reports (Outcome Duplicate: its events and the metric),
// in every mode.

import (
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
	"github.com/exactlyonce/watermill-exactlyonce/inbox"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
)

// TestDuplicatesCountedAsReported: six deliveries at once, then six more:
// three copies of a new key, two of a key done in the first round and a
// new one. In every mode and on both layouts, Stats' Duplicates equals the
// deliveries reported as Duplicate. With group commit the second round is
// one batch, so the copies of one key are in one batch.
// Before: group commit counted a key's copies within a batch as none (the
// batch claims each key once): 1 counted (the done key once), 4 reported.
func TestDuplicatesCountedAsReported(t *testing.T) {
	t.Parallel()
	for _, layout := range testenv.Layouts {
		for _, mode := range eoModes {
			t.Run(layout+"/"+mode.name, func(t *testing.T) {
				t.Parallel()
				db := testenv.SchemaLayout(t, layout)
				var log eventLog
				cfg := exactlyonce.Config{DB: db, Consumer: "c", NackDelay: -1, OnEvent: log.observe, Logger: testenv.Logger(t)}
				mode.set(&cfg)
				if cfg.Batch != nil {
					cfg.Batch = &exactlyonce.BatchConfig{MaxSize: 6, MaxWait: forever}
				}
				eo, err := exactlyonce.New(cfg)
				require.NoError(t, err)
				h := eo.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, nil })

				rounds := [][]string{
					{"done", "a", "b", "c", "d", "e"},
					{"new", "done", "new", "fresh", "done", "new"},
				}
				for _, keys := range rounds {
					// A lease held by a copy in flight nacks the others
					// (ErrLeaseHeld): redelivered, they are duplicates.
					pending := msgs(keys...)
					for try := 0; len(pending) > 0; try++ {
						require.Less(t, try, 20, "deliveries still nacked after 20 redeliveries")
						ds := deliver(t, h, pending...)
						var again []*message.Message
						for i, d := range ds {
							if d.err != nil {
								require.ErrorIs(t, d.err, exactlyonce.ErrLeaseHeld, "only a held lease may nack here")
								again = append(again, pending[i])
							}
						}
						pending = again
					}
				}
				if cfg.Batch != nil {
					for _, e := range log.of("new") {
						require.Equal(t, 6, e.BatchSize, "the second round is one batch")
					}
				}
				require.Equal(t, 4, log.count(exactlyonce.Duplicate), "two copies of new, both of done")
				require.Equal(t, 8, log.count(exactlyonce.Processed))

				store, err := inbox.NewStore(db)
				require.NoError(t, err)
				stats, err := store.Stats(t.Context(), "c")
				require.NoError(t, err)
				require.Equal(t, int64(log.count(exactlyonce.Duplicate)), stats.Duplicates, "the inbox counts the duplicates the middleware reports")
				for key, want := range map[string]int64{"new": 2, "done": 2, "fresh": 0} {
					rec, err := store.Get(t.Context(), "c", key)
					require.NoError(t, err)
					require.Equal(t, want, rec.Duplicates, key)
				}
			})
		}
	}
}
