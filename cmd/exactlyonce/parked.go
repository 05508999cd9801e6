package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/redis/go-redis/v9"
	"github.com/spf13/cobra"

	"github.com/exactlyonce/watermill-exactlyonce/inbox"
	"github.com/exactlyonce/watermill-exactlyonce/internal/ops"
	"github.com/exactlyonce/watermill-exactlyonce/rabbitmq"
	"github.com/exactlyonce/watermill-exactlyonce/redisstore"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// Environment variables of the parked commands.
const (
	envRedisURL    = "REDIS_URL"
	envRedisPrefix = "EXACTLYONCE_REDIS_PREFIX"
)

// parkedStore is the store the parked commands act on, through the
// operator layer (the PostgreSQL inbox, or the Redis lease store), with
// what the output says of it.
type parkedStore struct {
	ops.Store
	where string
	// db is the PostgreSQL inbox's database (nil for Redis): its unknown
	// consumers are an error, and its errors carry the migration hint.
	db *sqlschema.DB
}

// name says where the messages are, for the output.
func (s parkedStore) name() string { return s.where }

// checkConsumer fails (exit status 3) when the store knows the consumer
// has no record at all: a misspelled name. The Redis store keeps no list
// of its consumers, and finding a consumer's records means scanning the
// whole keyspace (a consumer without parked keys has no parked set): it
// knows nothing.
func (s parkedStore) checkConsumer(ctx context.Context, consumer string) error {
	if s.db == nil {
		return nil
	}
	return checkConsumer(ctx, *s.db, consumer)
}

// parkedFlags select parked messages.
type parkedFlags struct {
	searchFlags
	consumer, key, tenant string
	after                 string
}

func (f *parkedFlags) register(cmd *cobra.Command, bulk bool) {
	f.searchFlags.register(cmd, bulk)
	fl := cmd.Flags()
	fl.StringVarP(&f.consumer, "consumer", "c", "", "the consumer (the router handler's name by default); required with --redis-url")
	fl.StringVar(&f.key, "key", "", "the inbox key, as recorded")
	fl.StringVar(&f.tenant, "tenant", "", "the keys of one tenant (exactlyonce.KeyByTenant)")
	if !bulk {
		fl.StringVar(&f.after, "after", "", "the next page: the cursor the previous page printed")
	}
}

func (f *parkedFlags) anyCriterion() bool {
	return f.any() || f.consumer != "" || f.key != "" || f.tenant != ""
}

func (f *parkedFlags) filter(now time.Time) (inbox.ParkedFilter, error) {
	meta, err := f.metadata()
	if err != nil {
		return inbox.ParkedFilter{}, err
	}
	since, until, err := f.window(now)
	if err != nil {
		return inbox.ParkedFilter{}, err
	}
	return inbox.ParkedFilter{Consumer: f.consumer, Key: f.key, MessageUUID: f.uuid, Tenant: f.tenant,
		Reason: f.reason, Since: since, Before: until, Metadata: meta}, nil
}

// parkedOptions are the flags of the parked commands' stores.
type parkedOptions struct {
	redisURL    string
	redisPrefix string
	doneTTL     time.Duration
	amqpURL     string
	queueType   string
	partitions  map[string]int
}

func (a *app) parkedCmd() *cobra.Command {
	var o parkedOptions
	cmd := &cobra.Command{
		Use:   "parked",
		Short: "Find, show, replay and discard parked messages (PostgreSQL inbox, or the Redis lease store with --redis-url)",
		Long: `A key the middleware parked (a Permanent handler error, lease mode's interruptions, a completion
that can never commit) keeps the message it was parked with: its UUID, the topic it came from, its
payload and metadata. Find it (list: by consumer, key, UUID, tenant, reason, time, or a metadata
field such as a business id), read it (show), then replay it (the key is released and the message
published again with its UUID, to its topic: the consumer runs it once) or discard it (the key
becomes discarded, so a late redelivery is not run, unless --forget).

The actions on one key (CONSUMER KEY) take what you saw: --if-version (as parked show and inbox
show print it), --if-uuid, --if-status; a key that changed since is refused, exit status 4,
nothing done.

The PostgreSQL inbox is the default (--database-url); --redis-url (or $REDIS_URL when the flag is
given empty) works on the Redis lease store instead, whose replay publishes through RabbitMQ
(--amqp-url). Bulk replay and discard print how many messages match; --yes acts.

With the PostgreSQL inbox, a consumer that has no record at all (a misspelled name) is an error,
exit status 3, that lists the consumers that have records; the Redis store keeps no list of its
consumers, so there an unknown consumer finds no messages.`,
		Args: cobra.ArbitraryArgs,
		RunE: groupRunE,
	}
	pf := cmd.PersistentFlags()
	pf.StringVar(&o.redisURL, "redis-url", "", "the Redis lease store: redis://host:6379/0 (default: the PostgreSQL inbox)")
	pf.StringVar(&o.redisPrefix, "redis-prefix", os.Getenv(envRedisPrefix), "the Redis store's key prefix, as the service's redisstore.Config.Prefix (default $"+envRedisPrefix+", else exactlyonce:)")
	pf.DurationVar(&o.doneTTL, "redis-done-ttl", 7*24*time.Hour, "the Redis store's DoneTTL, as the service's (a released key expires after it)")
	pf.StringVar(&o.amqpURL, "amqp-url", "", "with --redis-url: RabbitMQ, to replay through, or a cluster's nodes separated by commas (default $"+envAMQPURL+")")
	pf.StringVar(&o.queueType, "queue-type", "classic", "with --redis-url: the type of the queues a replay declares, classic or quorum, as the relay's --queue-type")
	pf.StringToIntVar(&o.partitions, "topic-partitions", nil, "with --redis-url: partitioned topics, topic=n (repeatable), as the relay's --topic-partitions: a replayed message goes to the partition queue of its ordering key")

	var list parkedFlags
	listCmd := &cobra.Command{
		Use:   "list",
		Short: "Parked messages matching the criteria, oldest parked first",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			f, err := list.filter(time.Now())
			if err != nil {
				return err
			}
			return a.withParked(cmd, o, func(ctx context.Context, s parkedStore) error {
				return a.parkedList(ctx, s, f, inbox.Page{Limit: list.limit, After: list.after})
			})
		},
	}
	list.register(listCmd, false)

	var full bool
	show := &cobra.Command{
		Use:   "show CONSUMER KEY",
		Short: "One parked message: payload (its first 64 KiB, pretty-printed when JSON), metadata, reason, attempts, times, the key's status",
		Args:  exactArgs(2, "CONSUMER KEY"),
		RunE: func(cmd *cobra.Command, args []string) error {
			return a.withParked(cmd, o, func(ctx context.Context, s parkedStore) error {
				return a.parkedShow(ctx, s, args[0], args[1], full)
			})
		},
	}
	show.Flags().BoolVar(&full, "full-payload", false, fullPayloadUsage)

	var rp parkedFlags
	var rpIf ifFlags
	var topic string
	replay := &cobra.Command{
		Use:   "replay [CONSUMER KEY]",
		Short: "Release the key and publish the message again (its UUID, to its topic): one, or every match (--yes)",
		Args:  maxArgs(2, "CONSUMER KEY"),
		RunE: func(cmd *cobra.Command, args []string) error {
			return a.parkedAction(cmd, o, args, &rp, rpIf, "replay", func(ctx context.Context, s parkedStore, consumer, key string) (int64, error) {
				_, err := s.ReplayParked(ctx, consumer, key, inbox.ReplayOptions{Topic: topic, Expect: rpIf.expect()})
				return 1, err
			}, func(s parkedStore, f inbox.ParkedFilter) ops.ParkedBulk {
				return ops.ParkedBulk{Store: s, Filter: f, Verb: ops.VerbReplay, Topic: topic}
			})
		},
	}
	rp.register(replay, true)
	rpIf.register(replay, "exactlyonce parked show", true)
	replay.Flags().StringVar(&topic, "topic", "", "publish to this topic instead of the one it came from")

	var dc parkedFlags
	var dcIf ifFlags
	var forget bool
	discard := &cobra.Command{
		Use:   "discard [CONSUMER KEY]",
		Short: "Delete the kept message; the key becomes discarded (a redelivery is not run) unless --forget: one, or every match (--yes)",
		Args:  maxArgs(2, "CONSUMER KEY"),
		RunE: func(cmd *cobra.Command, args []string) error {
			return a.parkedAction(cmd, o, args, &dc, dcIf, "discard", func(ctx context.Context, s parkedStore, consumer, key string) (int64, error) {
				return 1, s.DiscardParked(ctx, consumer, key, inbox.DiscardOptions{Forget: forget, Expect: dcIf.expect()})
			}, func(s parkedStore, f inbox.ParkedFilter) ops.ParkedBulk {
				return ops.ParkedBulk{Store: s, Filter: f, Verb: ops.VerbDiscard, Forget: forget}
			})
		},
	}
	dc.register(discard, true)
	dcIf.register(discard, "exactlyonce parked show", true)
	discard.Flags().BoolVar(&forget, "forget", false, "also forget the key: its next delivery runs the handler")

	var rlIf ifFlags
	release := &cobra.Command{
		Use:   "release CONSUMER KEY",
		Short: "Let the key's next delivery run (parked -> failed); the kept message stays listed until replayed or discarded",
		Args:  exactArgs(2, "CONSUMER KEY"),
		RunE: func(cmd *cobra.Command, args []string) error {
			return a.withParked(cmd, o, func(ctx context.Context, s parkedStore) error {
				found, err := s.Release(ctx, args[0], args[1], rlIf.expect())
				if errors.Is(err, inbox.ErrNotFound) {
					found, err = false, nil
				}
				if err != nil {
					return parkedErr(ctx, s, "parked release", err)
				}
				if !found {
					if err := s.checkConsumer(ctx, args[0]); err != nil {
						return err
					}
					return notFoundErr("parked release: %q for %q is not parked", args[1], args[0])
				}
				return a.actionDone("release", 1, "key", "keys")
			})
		},
	}
	rlIf.register(release, "exactlyonce inbox show", true)
	cmd.AddCommand(listCmd, show, replay, discard, release)
	return cmd
}

// withParked opens the store the flags name and runs f.
func (a *app) withParked(cmd *cobra.Command, o parkedOptions, f func(context.Context, parkedStore) error) error {
	if !cmd.Flags().Changed("redis-url") {
		return a.withStore(cmd, false, func(ctx context.Context, db sqlschema.DB, s *inbox.Store) error {
			return f(ctx, parkedStore{Store: ops.Postgres(s, db), where: "inbox " + db.Schema + "." + db.InboxTable, db: &db})
		})
	}
	ctx, cancel := a.opContext(cmd, false)
	defer cancel()
	url := o.redisURL
	if url == "" {
		url = os.Getenv(envRedisURL)
	}
	if url == "" {
		return usageErr("--redis-url is empty and $%s is not set", envRedisURL)
	}
	opts, err := redis.ParseURL(url)
	if err != nil {
		return usageErr("--redis-url: %v", err)
	}
	client := redis.NewClient(opts)
	defer client.Close()
	if err := client.Ping(ctx).Err(); err != nil {
		return fmt.Errorf("redis at %s: %w", opts.Addr, err)
	}
	store, err := redisstore.New(redisstore.Config{Client: client, Prefix: o.redisPrefix, DoneTTL: o.doneTTL})
	if err != nil {
		return usageErr("%v", err)
	}
	var pub *rabbitmq.Publisher
	defer func() {
		if pub != nil {
			_ = pub.Close()
		}
	}()
	newPub := func() (message.Publisher, error) {
		if pub != nil {
			return pub, nil
		}
		amqpURL := o.amqpURL
		if amqpURL == "" {
			amqpURL = os.Getenv(envAMQPURL)
		}
		if amqpURL == "" {
			return nil, usageErr("a replay from the Redis store publishes through RabbitMQ: give --amqp-url (or $%s)", envAMQPURL)
		}
		if err := checkQueueType(o.queueType); err != nil {
			return nil, err
		}
		p, err := rabbitmq.NewPublisher(brokerConfig(amqpURL, o.queueType, o.partitions))
		if err != nil {
			return nil, usageErr("--amqp-url, --topic-partitions: %v", err)
		}
		pub = p
		return pub, nil
	}
	return f(ctx, parkedStore{Store: ops.Redis(store, newPub), where: "Redis " + opts.Addr})
}

type parkedJSON struct {
	Consumer     string            `json:"consumer"`
	Key          string            `json:"key"`
	UUID         string            `json:"uuid"`
	Topic        string            `json:"topic"`
	Status       string            `json:"status"`
	Reason       string            `json:"reason"`
	Attempts     int               `json:"attempts"`
	FirstSeenAt  *string           `json:"first_seen_at"`
	ParkedAt     *string           `json:"parked_at"`
	Metadata     map[string]string `json:"metadata"`
	PayloadBytes int               `json:"payload_bytes"`
	PayloadKept  bool              `json:"payload_kept"`
	Payload      *payloadJSON      `json:"payload,omitempty"`
	Version      string            `json:"version"`
	// PayloadTruncated, with the payload, reports whether it holds only
	// the payload's first bytes (show without --full-payload).
	PayloadTruncated *bool `json:"payload_truncated,omitempty"`
}

func parkedDoc(m inbox.ParkedMessage, withPayload bool) parkedJSON {
	d := parkedJSON{Consumer: m.Consumer, Key: m.Key, UUID: m.UUID, Topic: m.Topic, Status: m.Status, Reason: m.Reason,
		Attempts: m.Attempts, FirstSeenAt: jsonTime(&m.FirstSeenAt), ParkedAt: jsonTime(&m.ParkedAt), Metadata: m.Metadata,
		PayloadBytes: m.PayloadSize, PayloadKept: m.PayloadKept, Version: m.Version}
	if d.Metadata == nil {
		d.Metadata = map[string]string{}
	}
	if withPayload && m.PayloadKept {
		d.Payload, d.PayloadTruncated = shownPayloadDoc(m.Payload, m.PayloadSize)
	}
	return d
}

func (a *app) parkedList(ctx context.Context, s parkedStore, f inbox.ParkedFilter, p inbox.Page) error {
	page, err := s.FindParked(ctx, f, p)
	if err != nil {
		return parkedErr(ctx, s, "parked list", err)
	}
	if len(page.Messages) == 0 && f.Consumer != "" {
		if err := s.checkConsumer(ctx, f.Consumer); err != nil {
			return err
		}
	}
	if a.jsonOut {
		docs := make([]parkedJSON, len(page.Messages))
		for i, m := range page.Messages {
			docs[i] = parkedDoc(m, false)
		}
		return a.printJSON(struct {
			Messages []parkedJSON `json:"messages"`
			Next     string       `json:"next_after,omitempty"`
		}{docs, page.Next})
	}
	if len(page.Messages) == 0 {
		_, err := fmt.Fprintf(a.stdout, "No parked messages (%s).\n", s.name())
		return err
	}
	tw := newTable(a.stdout)
	fmt.Fprintln(tw, "CONSUMER\tKEY\tUUID\tPARKED\tSTATUS\tREASON")
	now := time.Now()
	for _, m := range page.Messages {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s ago\t%s\t%s\n", truncate(m.Consumer, 30), truncate(m.Key, 40), truncate(m.UUID, 36),
			fmtDuration(now.Sub(m.ParkedAt)), ops.KeyState(m.Status), truncate(m.Reason, 70))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if page.Next != "" {
		_, err = fmt.Fprintf(a.stdout, "\nMore: the same command with --after %s\n", page.Next)
		return err
	}
	_, err = fmt.Fprintln(a.stdout, "\nRead one: exactlyonce parked show CONSUMER KEY; replay it: exactlyonce parked replay CONSUMER KEY")
	return err
}

func (a *app) parkedShow(ctx context.Context, s parkedStore, consumer, key string, full bool) error {
	var m inbox.ParkedMessage
	var err error
	if full {
		m, err = s.GetParked(ctx, consumer, key)
	} else {
		m, err = s.GetParkedPrefix(ctx, consumer, key, showPayloadBytes)
	}
	if err != nil {
		return parkedErr(ctx, s, "parked show", consumerFirst(ctx, s, consumer, err))
	}
	if a.jsonOut {
		return a.printJSON(parkedDoc(m, true))
	}
	tw := newTable(a.stdout)
	now := time.Now()
	fmt.Fprintf(tw, "consumer\t%s\n", m.Consumer)
	fmt.Fprintf(tw, "key\t%s\n", m.Key)
	fmt.Fprintf(tw, "status\t%s\n", ops.KeyState(m.Status))
	fmt.Fprintf(tw, "uuid\t%s\n", m.UUID)
	fmt.Fprintf(tw, "topic\t%s\n", m.Topic)
	fmt.Fprintf(tw, "reason\t%s\n", m.Reason)
	fmt.Fprintf(tw, "attempts\t%d\n", m.Attempts)
	fmt.Fprintf(tw, "first seen\t%s\n", fmtTimeAgo(m.FirstSeenAt, now))
	fmt.Fprintf(tw, "parked\t%s\n", fmtTimeAgo(m.ParkedAt, now))
	fmt.Fprintf(tw, "version\t%s\n", m.Version)
	if err := tw.Flush(); err != nil {
		return err
	}
	payload := shownPayloadText(m.Payload, m.PayloadSize)
	if !m.PayloadKept {
		payload = ":\n(not kept: larger than the middleware keeps; re-publish it from its source, then release the key)"
	}
	_, err = fmt.Fprintf(a.stdout, "metadata:\n%spayload (%d bytes)%s\n", metadataLines(m.Metadata), m.PayloadSize, payload)
	return err
}

// parkedAction runs a replay or discard of one message (CONSUMER KEY) or of
// every match (with --yes; without, it says how many match).
func (a *app) parkedAction(cmd *cobra.Command, o parkedOptions, args []string, f *parkedFlags, cond ifFlags, verb string,
	one func(context.Context, parkedStore, string, string) (int64, error),
	bulk func(parkedStore, inbox.ParkedFilter) ops.ParkedBulk) error {
	if len(args) == 1 {
		return usageErr("give CONSUMER KEY, or criteria")
	}
	if len(args) != 2 && cond.any() {
		return usageErr("--if-version, --if-uuid and --if-status are for one message (CONSUMER KEY); a bulk action is bounded by its criteria")
	}
	return a.withParked(cmd, o, func(ctx context.Context, s parkedStore) error {
		if len(args) == 2 {
			if f.anyCriterion() || f.yes || f.confirm != "" {
				return usageErr("give CONSUMER KEY or criteria, not both")
			}
			n, err := one(ctx, s, args[0], args[1])
			if err != nil {
				return parkedErr(ctx, s, "parked "+verb, consumerFirst(ctx, s, args[0], err))
			}
			return a.actionDone(verb, n, "message", "messages")
		}
		if !f.anyCriterion() {
			return usageErr("give CONSUMER KEY, or criteria (-c, --key, --uuid, --tenant, --reason, --since, --until, --meta) with --yes")
		}
		filter, err := f.filter(time.Now())
		if err != nil {
			return err // a usage error, before any round trip
		}
		build := func(asOf time.Time) (ops.Target, error) {
			var err error
			filter, err = f.filter(asOf)
			return bulk(s, filter), err
		}
		target, c, act, err := f.confirmation(ctx, s.Now, build, false)
		if err != nil {
			return parkedErr(ctx, s, "parked "+verb, err)
		}
		if !act {
			if c.Count == 0 && filter.Consumer != "" {
				if err := s.checkConsumer(ctx, filter.Consumer); err != nil {
					return err
				}
			}
			return a.wouldDo(verb, c, "message", "messages")
		}
		res, err := ops.Run(ctx, target, c)
		err = recount(ctx, err, s.Now, build, false)
		n, skipped := res.Done, res.Skipped
		if err != nil {
			return parkedErr(ctx, s, fmt.Sprintf("parked %s (%d done before the error)", verb, n), bulkErr(err))
		}
		if n == 0 && skipped == 0 {
			if filter.Consumer != "" {
				if err := s.checkConsumer(ctx, filter.Consumer); err != nil {
					return err
				}
			}
			// One rule with the single form: nothing to act on is exit 3.
			return notFoundErr("parked %s: no parked message matches the criteria (%s): nothing done", verb, s.name())
		}
		if skipped > 0 && !a.jsonOut {
			defer fmt.Fprintf(a.stdout, "%s skipped: not replayable (parked show says why), or replayed or discarded by someone else meanwhile.\n", plural(skipped, "message", "messages"))
		}
		return a.actionDone(verb, n, "message", "messages")
	})
}

// consumerFirst is err, or the unknown-consumer error when err says the
// key or its message is not there and the consumer has no record at all.
func consumerFirst(ctx context.Context, s parkedStore, consumer string, err error) error {
	if errors.Is(err, inbox.ErrNotParked) || errors.Is(err, inbox.ErrNotFound) {
		if cerr := s.checkConsumer(ctx, consumer); cerr != nil {
			return cerr
		}
	}
	return err
}

// parkedErr maps the stores' errors to exit codes.
func parkedErr(ctx context.Context, s parkedStore, what string, err error) error {
	var ee *exitError
	switch {
	case errors.As(err, &ee):
		return err
	case errors.Is(err, inbox.ErrNotParked), errors.Is(err, inbox.ErrNotFound):
		return notFoundErr("%s: %v", what, err)
	case errors.Is(err, inbox.ErrInvalidFilter):
		return usageErr("%s: %v", what, err)
	case errors.Is(err, inbox.ErrNotReplayable):
		return &exitError{code: exitFailed, err: fmt.Errorf("%s: %w", what, err)}
	}
	if s.db != nil {
		return opErr(ctx, *s.db, what, err)
	}
	return fmt.Errorf("%s: %w", what, err)
}
