package outbox

import (
	stdsql "database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
)

// errNotForSubscribing is returned by the schema adapter's read side: outbox
// rows are read by Relay, not by watermill-sql's subscriber.
var errNotForSubscribing = errors.New("outbox: this schema adapter only writes; read the outbox with outbox.Relay")

// schemaAdapter makes watermill-sql's publisher write every topic into one
// outbox table, with the topic as a column.
type schemaAdapter struct {
	table string
}

var _ wsql.SchemaAdapter = schemaAdapter{}

func (s schemaAdapter) InsertQuery(params wsql.InsertQueryParams) (wsql.Query, error) {
	return s.insertQuery(params, nil)
}

// insertQuery is the INSERT of params' messages. With lock (the sorted
// hashes of ordering keys, see lockHashes), the statement first takes
// the transaction-level advisory lock of each, in that order, and only then
// draws the rows' ids: the locks are a one-time filter of the plan (an
// InitPlan), evaluated before the first row, and the id default is computed
// with each row after it. One statement, so that a Publish outside a
// transaction (its own autocommit transaction) holds the locks until its
// rows are committed, like one inside.
func (s schemaAdapter) insertQuery(params wsql.InsertQueryParams, lock []int32) (wsql.Query, error) {
	if len(params.Msgs) == 0 {
		return wsql.Query{}, errors.New("outbox: no messages to insert")
	}
	var b strings.Builder
	b.WriteString("INSERT INTO " + s.table + " (topic, uuid, payload, metadata, ordering_key) ")
	if len(lock) > 0 {
		b.WriteString("SELECT * FROM (")
	}
	b.WriteString("VALUES ")
	args := make([]any, 0, 5*len(params.Msgs))
	for i, msg := range params.Msgs {
		if msg == nil {
			return wsql.Query{}, fmt.Errorf("outbox: message %d is nil", i)
		}
		if msg.UUID == "" {
			return wsql.Query{}, fmt.Errorf("outbox: message %d has an empty UUID; the next consumer's inbox needs it", i)
		}
		meta, err := json.Marshal(msg.Metadata)
		if err != nil {
			return wsql.Query{}, fmt.Errorf("outbox: marshaling metadata of message %s: %w", msg.UUID, err)
		}
		if msg.Metadata == nil {
			meta = []byte("{}")
		}
		if i > 0 {
			b.WriteByte(',')
		}
		n := 5 * i
		b.WriteString("($" + strconv.Itoa(n+1) + "::text,$" + strconv.Itoa(n+2) + "::text,$" + strconv.Itoa(n+3) + "::bytea,$" + strconv.Itoa(n+4) + "::jsonb,$" + strconv.Itoa(n+5) + "::text)")
		payload := []byte(msg.Payload)
		if payload == nil {
			payload = []byte{}
		}
		args = append(args, params.Topic, msg.UUID, payload, string(meta), orderingKeyArg(msg))
	}
	if len(lock) > 0 {
		n := len(args)
		b.WriteString(") AS v WHERE (SELECT count(pg_advisory_xact_lock($" + strconv.Itoa(n+1) + "::int4, k)) FROM unnest($" + strconv.Itoa(n+2) + "::int4[]) AS k) >= 0")
		args = append(args, lockClass(s.table), lock)
	}
	return wsql.Query{Query: b.String(), Args: args}, nil
}

func (s schemaAdapter) SelectQuery(wsql.SelectQueryParams) (wsql.Query, error) {
	return wsql.Query{}, errNotForSubscribing
}

func (s schemaAdapter) UnmarshalMessage(wsql.UnmarshalMessageParams) (wsql.Row, error) {
	return wsql.Row{}, errNotForSubscribing
}

func (s schemaAdapter) SchemaInitializingQueries(wsql.SchemaInitializingQueriesParams) ([]wsql.Query, error) {
	return nil, errors.New("outbox: tables are created by sqlschema.Migrate, never implicitly")
}

func (s schemaAdapter) SubscribeIsolationLevel() stdsql.IsolationLevel {
	return stdsql.LevelReadCommitted
}
