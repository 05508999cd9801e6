package outbox

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/exactlyonce/watermill-exactlyonce/internal/outboxdb"
)

// batch is a locked batch: the rows to publish, in id order, and the rows
// whose metadata cannot be decoded.
type batch struct {
	ids     []int64
	topics  []string
	msgs    []*message.Message
	retry   []bool   // the row failed before
	keys    []string // ordering keys, "" for none
	defects []defect
	// blocked counts the rows locked but left as they were: an earlier row
	// of their ordering key is not in the batch (another relay has it in
	// flight, or its topic is paused), or is a defect of this batch.
	blocked int
}

// reordered returns the batch's rows in the given order (indexes into b).
func (b batch) reordered(order []int) batch {
	out := batch{defects: b.defects,
		ids: make([]int64, len(order)), topics: make([]string, len(order)),
		msgs: make([]*message.Message, len(order)), retry: make([]bool, len(order)), keys: make([]string, len(order))}
	for j, i := range order {
		out.ids[j], out.topics[j], out.msgs[j], out.retry[j], out.keys[j] = b.ids[i], b.topics[i], b.msgs[i], b.retry[i], b.keys[i]
	}
	return out
}

type defect struct {
	id  int64
	err error
}

// headWindow is how many batches' worth of the oldest rows a batch looks
// for the heads of keys among (internal/outboxdb's ClaimKeyed).
const headWindow = 4

func (r *Relay) lockBatch(ctx context.Context, tx wsql.Tx) (batch, error) {
	// Rows that failed before take at most half a batch when enough others
	// wait; with BatchSize 1, every other batch.
	half := r.cfg.BatchSize / 2
	if r.cfg.BatchSize == 1 {
		half = int(r.alternate.Add(1) % 2)
	}
	paused := r.pauses.active(time.Now())
	keyed, err := r.store.Probe(ctx, tx)
	if err != nil {
		return batch{}, fmt.Errorf("outbox relay: selecting batch: %w", err)
	}
	rows, err := r.store.ClaimBatch(ctx, tx, outboxdb.Claim{
		Size: r.cfg.BatchSize, Retry: half, Paused: paused, Keyed: keyed, Window: headWindow * r.cfg.BatchSize,
	})
	if err != nil {
		return batch{}, fmt.Errorf("outbox relay: selecting batch: %w", err)
	}
	var b batch
	// Keys whose chain stops in this batch: a row of the key is blocked or
	// a defect, so the rows of the key after it wait too (rows come in id
	// order).
	stopped := map[string]bool{}
	for _, row := range rows {
		id, topic, uuid, k := row.ID, row.Topic, row.UUID, row.OrderingKey
		if k != "" && (row.Blocked || stopped[k]) {
			stopped[k] = true
			b.blocked++
			continue
		}
		msg := message.NewMessage(uuid, row.Payload)
		if err := json.Unmarshal([]byte(row.Metadata), &msg.Metadata); err != nil {
			// No retry can fix it: quarantined at once, the rest goes on
			// (but the rows of its key wait behind it).
			b.defects = append(b.defects, defect{id, fmt.Errorf("row %d (topic %q, uuid %q) has unreadable metadata: %w", id, topic, uuid, err)})
			if k != "" {
				stopped[k] = true
			}
			continue
		}
		if msg.Metadata == nil {
			msg.Metadata = message.Metadata{}
		}
		msg.SetContext(ctx)
		b.ids = append(b.ids, id)
		b.topics = append(b.topics, topic)
		b.msgs = append(b.msgs, msg)
		b.retry = append(b.retry, row.Retry)
		b.keys = append(b.keys, k)
	}
	return b, nil
}
