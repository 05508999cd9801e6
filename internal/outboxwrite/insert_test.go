package outboxwrite

import (
	"slices"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/outboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/msgid"
)

func keyed(uuid, key string) *message.Message {
	m := message.NewMessage(uuid, []byte("p-"+uuid))
	if key != "" {
		m.Metadata.Set(msgid.OrderingKeyMetadata, key)
	}
	return m
}

// The INSERT binds one array per column, a message per index in the
// call's order (the ordering key "" when none: the statement stores NULL),
// and, with ordering keys, takes their locks (class, hashes) before it
// draws ids.
func TestInsertRows(t *testing.T) {
	t.Parallel()
	in, err := insertRows(7, "topic", []*message.Message{keyed("a", ""), keyed("b", "k")}, nil)
	require.NoError(t, err)
	require.Equal(t, outboxdb.Insert{
		Topic: "topic", UUIDs: []string{"a", "b"}, Payloads: [][]byte{[]byte("p-a"), []byte("p-b")},
		Metadata: []string{"{}", `{"ordering_key":"k"}`}, OrderingKeys: []string{"", "k"}, LockClass: 7,
	}, in)

	lock := lockHashes([]*message.Message{keyed("b", "k")})
	in, err = insertRows(7, "topic", []*message.Message{keyed("b", "k")}, lock)
	require.NoError(t, err)
	require.Equal(t, int32(7), in.LockClass)
	require.Equal(t, lock, in.Locks)

	in, err = insertRows(7, "topic", []*message.Message{message.NewMessage("n", nil)}, nil)
	require.NoError(t, err)
	require.Equal(t, [][]byte{{}}, in.Payloads, "a nil payload is stored empty (the column is NOT NULL)")

	_, err = insertRows(0, "topic", nil, nil)
	require.Error(t, err)
	_, err = insertRows(0, "topic", []*message.Message{nil}, nil)
	require.ErrorContains(t, err, "message 0 is nil")
	_, err = insertRows(0, "topic", []*message.Message{keyed("", "")}, nil)
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

// MySQL's key locks are rows of 16-bit buckets of the keys' hashes, sorted
// and distinct (two writers of the same keys upsert them in one order: no
// deadlock); none without keys. The keys of the lock tests have
// different buckets.
func TestLockBuckets(t *testing.T) {
	t.Parallel()
	require.Nil(t, lockBuckets(nil))
	hashes := lockHashes([]*message.Message{keyed("a", "K"), keyed("b", "L"), keyed("c", "K"), keyed("d", "M")})
	b := lockBuckets(hashes)
	require.Len(t, b, 3)
	require.True(t, slices.IsSorted(b))
	for _, x := range b {
		require.GreaterOrEqual(t, x, int32(0))
		require.LessOrEqual(t, x, int32(0xffff))
	}
	require.Equal(t, []int32{5}, lockBuckets([]int32{5, 5}))
	require.Equal(t, bucket(hash32("K")), lockBuckets(lockHashes([]*message.Message{keyed("a", "K")}))[0])
	require.Equal(t, int32(0x1234^0xabcd), bucket(int32(0x1234abcd)), "the high half is folded into the low one")
	require.Equal(t, int32(0xffff), bucket(-0x10000), "a negative hash folds to a positive bucket")
}

// An INSERT takes at most maxMessagesPerInsert messages, and on MySQL at
// most maxBytesPerInsertMySQL of payloads and metadata, but always one.
func TestChunk(t *testing.T) {
	t.Parallel()
	sized := func(n, size int) []*message.Message {
		out := make([]*message.Message, n)
		for i := range out {
			out[i] = message.NewMessage("m", make([]byte, size))
		}
		return out
	}
	pg, my := &Writer{}, &Writer{mysql: true}
	require.Equal(t, maxMessagesPerInsert, pg.chunk(sized(2500, 10)))
	require.Equal(t, 3, pg.chunk(sized(3, maxBytesPerInsertMySQL)), "PostgreSQL: no bound on bytes")
	require.Equal(t, maxMessagesPerInsert, my.chunk(sized(2500, 10)))
	require.Equal(t, 1, my.chunk(sized(3, maxBytesPerInsertMySQL)), "one message, even alone over the bound")
	require.Equal(t, 2, my.chunk(sized(5, maxBytesPerInsertMySQL/2)))
	require.Equal(t, 0, my.chunk(nil))
}
