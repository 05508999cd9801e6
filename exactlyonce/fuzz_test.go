package exactlyonce_test

// Fuzz target of the key strategies (issue 5). Run it with
//   go test -run '^$' -fuzz FuzzKeyStrategies -fuzztime 25s ./exactlyonce/

import (
	"context"
	stdsql "database/sql"
	"fmt"
	"net"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// errFuzzDB looks like an unreachable database: a refused TCP connection.
var errFuzzDB = fmt.Errorf("fuzz: database refused on purpose: %w", &net.OpError{Op: "dial", Net: "tcp", Err: syscall.ECONNREFUSED})

// fuzzDB refuses every transaction and counts the attempts: a key the
// middleware accepts reaches BeginTx (and fails there, closed), a key it
// rejects never does. Exec and Query count as touching the database too.
type fuzzDB struct{ begins atomic.Int64 }

func (d *fuzzDB) BeginTx(context.Context, *stdsql.TxOptions) (wsql.Tx, error) {
	d.begins.Add(1)
	return nil, errFuzzDB
}

func (d *fuzzDB) ExecContext(context.Context, string, ...any) (wsql.Result, error) {
	d.begins.Add(1)
	return nil, errFuzzDB
}

func (d *fuzzDB) QueryContext(context.Context, string, ...any) (wsql.Rows, error) {
	d.begins.Add(1)
	return nil, errFuzzDB
}

// fuzzKeyError is the sentinel Store.ValidateKey must return for
// (consumer, key), in its order of checks; nil when the pair is storable.
func fuzzKeyError(consumer, key string, limit int) error {
	bad := func(s string) bool { return !utf8.ValidString(s) || strings.Contains(s, "\x00") }
	switch {
	case consumer == "":
		return inboxdb.ErrEmptyConsumer
	case bad(consumer):
		return inboxdb.ErrInvalidKey
	case key == "":
		return inboxdb.ErrEmptyKey
	case len(key) > limit:
		return inboxdb.ErrKeyTooLong
	case bad(key):
		return inboxdb.ErrInvalidKey
	}
	return nil
}

// FuzzKeyStrategies combines every key strategy (the default UUID key,
// KeyFromMetadata, KeyFromPayloadSHA256) with Store.ValidateKey and the
// middleware itself, in both modes, for any UUID, metadata value, payload,
// consumer name and MaxKeyLength: nothing panics; each strategy returns what
// it promises (the UUID, the field, 64 lowercase hex digits); ValidateKey
// accepts exactly the storable keys (non-empty, at most the limit, UTF-8
// without NUL) and names the reason otherwise; the middleware rejects the
// others before touching the database (Outcome Nacked with ErrInvalidKey,
// the same sentinel, the handler not run) and takes the storable ones to the database.
func FuzzKeyStrategies(f *testing.F) {
	f.Add("uuid-1", "idem-1", []byte("hello"), "consumer", uint16(0))
	f.Add("", "", []byte{}, "c", uint16(0))
	f.Add("\xff\xfe", "a\x00b", []byte{0}, "c", uint16(1))
	f.Add(strings.Repeat("k", 1025), strings.Repeat("é", 513), []byte(strings.Repeat("x", 4096)), "c", uint16(0))
	f.Add(strings.Repeat("k", 2048), "\xc3", []byte("{}"), "c", uint16(2048))
	f.Add(`'; DROP TABLE x; --`, `$$\'$$`, []byte(`E'\x00'`), `it's "c"`, uint16(63))
	f.Add("ключ-🔑", "😀", []byte("\xed\xa0\x80"), "", uint16(64))
	f.Add("k", "k", []byte("k"), "c\x00", uint16(5))
	f.Add("k", "k", []byte("k"), "\xff", uint16(5))

	f.Fuzz(func(t *testing.T, uuid, meta string, payload []byte, consumer string, maxLen uint16) {
		max := int(maxLen % 2049) // 0 means the default
		limit := max
		if limit == 0 {
			limit = inboxdb.DefaultMaxKeyLength
		}
		store, err := inboxdb.NewStore(inboxdb.Config{MaxKeyLength: max})
		require.NoError(t, err)

		const field = "idempotency_key"
		newMsg := func() *message.Message {
			msg := message.NewMessage(uuid, payload)
			msg.Metadata.Set(field, meta)
			return msg
		}
		strategies := []struct {
			name string
			// key is the Config.Key of the strategy: nil for the default
			// (the UUID), which keyOf then stands for.
			key  func(*message.Message) (string, error)
			want func(string) // checks the key the strategy returned
		}{
			{"uuid", nil, func(k string) { require.True(t, k == uuid) }},
			{"metadata", exactlyonce.KeyFromMetadata(field), func(k string) { require.True(t, k == meta) }},
			{"sha256", exactlyonce.KeyFromPayloadSHA256, func(k string) {
				require.Len(t, k, 64)
				require.Equal(t, strings.Trim(k, "0123456789abcdef"), "", "lowercase hex: %q", k)
			}},
		}
		for _, s := range strategies {
			keyOf := s.key
			if keyOf == nil {
				keyOf = exactlyonce.Config{}.WithDefaults().Key
			}
			key, err := keyOf(newMsg())
			require.NoError(t, err, s.name)
			s.want(key)

			want := fuzzKeyError(consumer, key, limit)
			verr := store.ValidateKey(consumer, key)
			if want == nil {
				require.NoError(t, verr, "%s: %q", s.name, key)
				// Storable text within the limit.
				require.True(t, utf8.ValidString(key) && !strings.Contains(key, "\x00") && key != "" && len(key) <= limit)
			} else {
				require.ErrorIs(t, verr, want, "%s: %q", s.name, key)
			}

			for _, lease := range []*exactlyonce.LeaseConfig{nil, {}} { // transactional, lease
				db := &fuzzDB{}
				var events []exactlyonce.Event
				m, err := exactlyonce.New(exactlyonce.Config{
					DB: sqlschema.DB{Conn: db}, Lease: lease, Key: s.key, Consumer: consumer, MaxKeyLength: max,
					NackDelay: -1, OnEvent: func(e exactlyonce.Event) { events = append(events, e) },
					Logger: watermill.NopLogger{},
				})
				require.NoError(t, err)
				ran := false
				msg := newMsg()
				out, err := m.Middleware(func(*message.Message) ([]*message.Message, error) {
					ran = true
					return nil, nil
				})(msg)
				require.False(t, ran, "the handler must not run: the key is invalid or the database refused")
				require.Nil(t, out)
				require.Error(t, err)
				require.Len(t, events, 1)
				require.Equal(t, context.Background(), msg.Context(), "the message context is restored")
				if want != nil {
					require.ErrorIs(t, err, want, "%s", s.name)
					require.ErrorIs(t, err, exactlyonce.ErrInvalidKey, "%s", s.name)
					require.Equal(t, exactlyonce.Nacked, events[0].Outcome)
					require.ErrorIs(t, events[0].Err, exactlyonce.ErrInvalidKey, "rejected")
					require.Zero(t, db.begins.Load(), "a rejected key never reaches the database")
					continue
				}
				require.ErrorIs(t, err, exactlyonce.ErrDBUnavailable, "%s", s.name)
				require.ErrorIs(t, err, errFuzzDB)
				require.Equal(t, exactlyonce.Nacked, events[0].Outcome)
				require.ErrorIs(t, events[0].Err, exactlyonce.ErrDBUnavailable)
				require.NotErrorIs(t, events[0].Err, exactlyonce.ErrInvalidKey)
				require.NotErrorIs(t, events[0].Err, exactlyonce.ErrClaimFailed)
				require.True(t, events[0].Key == key)
				require.Equal(t, consumer, events[0].Consumer)
				require.Equal(t, int64(1), db.begins.Load())
			}
		}
	})
}
