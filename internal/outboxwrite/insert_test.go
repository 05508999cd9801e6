package outboxwrite

import (
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/msgid"
)

func keyed(uuid, key string) *message.Message {
	m := message.NewMessage(uuid, []byte("p-"+uuid))
	if key != "" {
		m.Metadata.Set(msgid.OrderingKeyMetadata, key)
	}
	return m
}

// The INSERT binds five values per message (the ordering key NULL when
// none), and, with ordering keys, takes their locks (class, hashes) before
// it draws ids.
func TestInsertQuery(t *testing.T) {
	t.Parallel()
	q, args, err := insertQuery(`"s"."o"`, 7, "topic", []*message.Message{keyed("a", ""), keyed("b", "k")}, nil)
	require.NoError(t, err)
	require.Equal(t, `INSERT INTO "s"."o" (topic, uuid, payload, metadata, ordering_key) VALUES ($1::text,$2::text,$3::bytea,$4::jsonb,$5::text),($6::text,$7::text,$8::bytea,$9::jsonb,$10::text)`, q)
	require.Equal(t, []any{"topic", "a", []byte("p-a"), "{}", nil, "topic", "b", []byte("p-b"), `{"ordering_key":"k"}`, "k"}, args)

	lock := lockHashes([]*message.Message{keyed("b", "k")})
	q, args, err = insertQuery(`"s"."o"`, 7, "topic", []*message.Message{keyed("b", "k")}, lock)
	require.NoError(t, err)
	require.True(t, strings.HasPrefix(q, `INSERT INTO "s"."o" (topic, uuid, payload, metadata, ordering_key) SELECT * FROM (VALUES `), q)
	require.True(t, strings.HasSuffix(q, `) AS v WHERE (SELECT count(pg_advisory_xact_lock($6::int4, k)) FROM unnest($7::int4[]) AS k) >= 0`), q)
	require.Equal(t, []any{int32(7), lock}, args[5:])

	_, _, err = insertQuery("t", 0, "topic", nil, nil)
	require.Error(t, err)
	_, _, err = insertQuery("t", 0, "topic", []*message.Message{nil}, nil)
	require.ErrorContains(t, err, "message 0 is nil")
	_, _, err = insertQuery("t", 0, "topic", []*message.Message{keyed("", "")}, nil)
	require.ErrorContains(t, err, "empty UUID")
}

// The locks of a call's keys are sorted and distinct (two writers of the
// same keys take them in one order: no deadlock); none without keys.
func TestLockHashes(t *testing.T) {
	t.Parallel()
	require.Nil(t, lockHashes([]*message.Message{keyed("a", "")}))
	h := lockHashes([]*message.Message{keyed("a", "x"), keyed("b", "y"), keyed("c", "x"), keyed("d", "")})
	require.Len(t, h, 2)
	require.Less(t, h[0], h[1])
	require.ElementsMatch(t, []int32{hash32("x"), hash32("y")}, h)
	require.NotEqual(t, LockClass(`"a"."o"`), LockClass(`"b"."o"`), "each table has its own class")
}

func TestCheckOrderingKeys(t *testing.T) {
	t.Parallel()
	require.NoError(t, checkOrderingKeys([]*message.Message{keyed("a", strings.Repeat("k", MaxOrderingKeyBytes))}))
	require.ErrorContains(t, checkOrderingKeys([]*message.Message{keyed("a", strings.Repeat("k", MaxOrderingKeyBytes+1))}),
		`message "a": its ordering key is 1025 bytes, the most is 1024`)
}
