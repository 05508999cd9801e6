package exactlyonce_test

import (
	"context"
	stdsql "database/sql"
	"errors"
	"strings"
	"testing"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

func TestKeyStrategies(t *testing.T) {
	t.Parallel()
	msg := message.NewMessage("uuid-1", []byte("hello"))
	msg.Metadata.Set("idempotency_key", "idem-7")

	// The default key (Config.Key nil) is the message UUID.
	k, err := exactlyonce.Config{}.WithDefaults().Key(msg)
	require.NoError(t, err)
	require.Equal(t, "uuid-1", k)

	k, err = exactlyonce.KeyFromMetadata("idempotency_key")(msg)
	require.NoError(t, err)
	require.Equal(t, "idem-7", k)

	k, err = exactlyonce.KeyFromPayloadSHA256(msg)
	require.NoError(t, err)
	// sha256("hello")
	require.Equal(t, "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824", k)

	other := message.NewMessage("uuid-2", []byte("hellp"))
	k2, _ := exactlyonce.KeyFromPayloadSHA256(other)
	require.NotEqual(t, k, k2, "distinct payloads must not share a key")
}

// refusingDB fails the test if the middleware touches the database: keys
// must be rejected before any transaction begins.
type refusingDB struct{ t *testing.T }

func (r refusingDB) BeginTx(context.Context, *stdsql.TxOptions) (wsql.Tx, error) {
	r.t.Error("BeginTx called for a message that should have been rejected")
	return nil, errors.New("refused")
}

func (r refusingDB) ExecContext(context.Context, string, ...any) (wsql.Result, error) {
	r.t.Error("ExecContext called")
	return nil, errors.New("refused")
}

func (r refusingDB) QueryContext(context.Context, string, ...any) (wsql.Rows, error) {
	r.t.Error("QueryContext called")
	return nil, errors.New("refused")
}

func TestBadKeysAreRejectedBeforeTheDatabase(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		key  string
		want error
	}{
		{"empty", "", inboxdb.ErrEmptyKey},
		{"10KB", strings.Repeat("k", 10*1024), inboxdb.ErrKeyTooLong},
		{"non-UTF-8", "abc\xff\xfe", exactlyonce.ErrInvalidKey},
		{"NUL", "a\x00b", exactlyonce.ErrInvalidKey},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var counters testenv.Counters
			eo, err := exactlyonce.New(exactlyonce.Config{
				DB: sqlschema.DB{Conn: refusingDB{t}}, Consumer: "c", OnEvent: counters.Observe, NackDelay: -1,
				Key: exactlyonce.KeyFromMetadata("k"), Logger: testenv.Logger(t),
			})
			require.NoError(t, err)
			ran := false
			msg := message.NewMessage("u", nil)
			msg.Metadata.Set("k", tc.key)
			_, err = eo.Middleware(func(*message.Message) ([]*message.Message, error) {
				ran = true
				return nil, nil
			})(msg)
			require.ErrorIs(t, err, tc.want)
			require.ErrorIs(t, err, exactlyonce.ErrInvalidKey, "every key problem is ErrInvalidKey")
			require.False(t, ran, "handler must not run")
			require.Equal(t, int64(1), counters.Rejected.Load())
		})
	}
}

// An empty key's error says what to do: for the default key (an empty
// UUID), set one or configure Config.Key, naming the consumer; for a
// Config.Key that returned an empty key, blame the key function, not the
// message's UUID.
func TestEmptyKeyErrorSaysWhatToDo(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name        string
		key         func(*message.Message) (string, error) // Config.Key
		uuid        string
		contains    []string
		notContains string
		why         string
	}{
		{name: "empty UUID", uuid: "", contains: []string{"message_id", "Config.Key", `"notify"`}},
		{
			name: "custom key function", key: exactlyonce.KeyFromMetadata("idempotency_key"), uuid: "has-a-uuid",
			contains:    []string{"Config.Key returned an empty key"},
			notContains: "set a UUID", why: "the message has a UUID: the hint must not send the user there",
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			eo, err := exactlyonce.New(exactlyonce.Config{DB: sqlschema.DB{Conn: refusingDB{t}}, Consumer: "notify", NackDelay: -1,
				Key: tc.key, Logger: testenv.Logger(t)})
			require.NoError(t, err)
			_, err = eo.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, nil })(message.NewMessage(tc.uuid, nil))
			require.ErrorIs(t, err, inboxdb.ErrEmptyKey)
			require.ErrorIs(t, err, exactlyonce.ErrInvalidKey)
			for _, want := range tc.contains {
				require.Contains(t, err.Error(), want)
			}
			if tc.notContains != "" {
				require.NotContains(t, err.Error(), tc.notContains, tc.why)
			}
		})
	}
}

func TestNewValidatesConfig(t *testing.T) {
	t.Parallel()
	_, err := exactlyonce.New(exactlyonce.Config{})
	require.ErrorContains(t, err, "Config.DB")
	_, err = exactlyonce.New(exactlyonce.Config{DB: sqlschema.DB{Conn: refusingDB{t}}, MaxKeyLength: 5000})
	require.ErrorContains(t, err, "MaxKeyLength")
}

func FuzzKeyFromPayloadSHA256(f *testing.F) {
	f.Add([]byte("hello"))
	f.Add([]byte{})
	f.Add([]byte{0xff, 0x00})
	f.Fuzz(func(t *testing.T, payload []byte) {
		k, err := exactlyonce.KeyFromPayloadSHA256(message.NewMessage("u", payload))
		require.NoError(t, err)
		require.Len(t, k, 64, "hex SHA-256 is always 64 characters, a valid key")
	})
}
