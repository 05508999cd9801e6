-- The data set of BenchmarkConsole (console/bench_test.go): an inbox of
-- {{N}} records over 20 consumers, {{P}} of them parked with their messages
-- in the table of parked messages, and an outbox backlog. Set-based (INSERT
-- ... SELECT generate_series): every column is a function of the row's
-- number g, so the inbox record and the parked message of a key agree.
--
-- The benchmark renders the placeholders ({{schema}}, {{inbox}}, {{parked}},
-- {{outbox}} are quoted names; {{N}}, {{P}}, {{O}}, {{stride}}, {{anchor}}
-- values)
-- and runs the steps in order, each "-- step:" line starting one; a step
-- "chunked over N" (or P) runs once per range {{lo}}..{{hi}} of 1..N (or
-- 1..P), a million at a time, so that no statement runs for many minutes.
--
-- The shape:
--   * 20 consumers, skewed: consumer c has (2c+1)/400 of the records, from
--     0.25% (audit.exporter) to 9.75% (orders.placed-projector); 4 scope
--     their keys by tenant ("acme:<uuid>"); 6 run in lease mode (their
--     records may be failed or processing; idempotency key format 2).
--   * First seen over 30 days before {{anchor}}, in g's order (the heap is
--     in time order, as a live inbox is); keys are random UUIDs.
--   * Every {{stride}}-th record (g % stride = 0, the first P of them) is
--     parked; its message parked a few seconds after it was first seen.
--     One consumer (payments.refund-worker) parks only in the last 2 days
--     (an incident): its parked messages are all recent.
--   * Parked messages: metadata with a business id (order_id, about one in
--     five orders parked by two consumers), customer_id, tenant (scoped
--     consumers), event_type, source, correlation_id, traceparent; one of
--     8 reasons; a JSON payload of 200-500 bytes (0.2% over the limit: not
--     kept).
--   * Outbox: {{O}} rows: 2% quarantined (the first, oldest ids; a large
--     payload's error), 1% failing (retried with backoff), the rest
--     pending; half carry an ordering key (a customer, about 4 rows each,
--     so that a failed row has rows waiting behind it).

-- step: helper functions
CREATE OR REPLACE FUNCTION {{schema}}.bench_h(g bigint, salt bigint, m bigint) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$ SELECT abs(hashint8extended(g, salt)) % m $$;

-- Consumer of a record that is not parked: c = floor(20 * sqrt(x)), so
-- consumer c has (2c+1)/400 of the records (0.25% for the first, 9.75%
-- for the last).
CREATE OR REPLACE FUNCTION {{schema}}.bench_consumer(g bigint) RETURNS int
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
SELECT least(19, floor(20 * sqrt({{schema}}.bench_h(g, 1, 1000000)::float8 / 1e6)))::int $$;

CREATE OR REPLACE FUNCTION {{schema}}.bench_is_parked(g bigint) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$ SELECT g % {{stride}} = 0 AND g / {{stride}} <= {{P}} $$;

-- Consumer of a parked record: as above, except that consumer 13
-- (payments.refund-worker) parks only in the last 2 of the 30 days, where it
-- takes 60% of the parks.
CREATE OR REPLACE FUNCTION {{schema}}.bench_pconsumer(g bigint) RETURNS int
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
SELECT CASE
  WHEN g > {{N}}::bigint * 28 / 30 AND {{schema}}.bench_h(g, 7, 10) < 6 THEN 13
  WHEN {{schema}}.bench_consumer(g) = 13 THEN 19
  ELSE {{schema}}.bench_consumer(g) END $$;

CREATE OR REPLACE FUNCTION {{schema}}.bench_c(g bigint) RETURNS int
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
SELECT CASE WHEN {{schema}}.bench_is_parked(g) THEN {{schema}}.bench_pconsumer(g) ELSE {{schema}}.bench_consumer(g) END $$;

CREATE OR REPLACE FUNCTION {{schema}}.bench_consumer_name(c int) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
SELECT (ARRAY['audit.exporter', 'orders.tenant-sync', 'billing.ledger-writer', 'search.indexer', 'crm.contact-sync',
  'orders.tenant-projector', 'shipping.label-printer', 'loyalty.points', 'notifications.email', 'tenants.usage-meter',
  'warehouse.reservations', 'fraud.scoring', 'inventory.stock-projector', 'payments.refund-worker', 'tenants.invoice-mailer',
  'analytics.events', 'billing.invoice-created', 'payments.capture', 'orders.fulfilment', 'orders.placed-projector'])[c + 1] $$;

-- Consumers 1, 5, 9 and 14 scope their keys by tenant; 2, 5, 8, 11, 14 and
-- 17 run in lease mode.
-- (c is bench_c(g), passed in so that it is computed once.)
CREATE OR REPLACE FUNCTION {{schema}}.bench_tenant(g bigint, c int) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
SELECT CASE WHEN c IN (1, 5, 9, 14) THEN
  (ARRAY['acme', 'globex', 'initech', 'umbrella', 'hooli', 'stark', 'wayne', 'wonka', 'tyrell', 'cyberdyne'])[{{schema}}.bench_h(g, 3, 10) + 1]
END $$;

CREATE OR REPLACE FUNCTION {{schema}}.bench_uuid(g bigint) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$ SELECT md5('m' || g)::uuid::text $$;

CREATE OR REPLACE FUNCTION {{schema}}.bench_key(g bigint, tenant text) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
SELECT coalesce(tenant || ':', '') || {{schema}}.bench_uuid(g) $$;

CREATE OR REPLACE FUNCTION {{schema}}.bench_lease(c int) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$ SELECT c % 3 = 2 $$;

CREATE OR REPLACE FUNCTION {{schema}}.bench_first_seen(g bigint) RETURNS timestamptz
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
SELECT '{{anchor}}'::timestamptz - make_interval(secs => ({{N}} - g) * (2592000.0::float8 / {{N}})) $$;

-- The 8 reasons (in shares of 100); consumer 13's incident has its own.
CREATE OR REPLACE FUNCTION {{schema}}.bench_reason(g bigint, c int) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
SELECT CASE
  WHEN c = 13 THEN 'permanent: refund provider rejected the request: currency HUF is not supported for card refunds'
  WHEN {{schema}}.bench_lease(c) AND {{schema}}.bench_h(g, 4, 100) < 30 THEN
    'lease expired during 3 attempts (interrupted): the effect of the last attempt is unknown'
  ELSE CASE
    WHEN {{schema}}.bench_h(g, 5, 100) < 30 THEN 'permanent: payment declined: card expired'
    WHEN {{schema}}.bench_h(g, 5, 100) < 55 THEN 'permanent: invalid shipping address: postcode ' || lpad({{schema}}.bench_h(g, 6, 100000)::text, 5, '0') || ' does not match country "DE"'
    WHEN {{schema}}.bench_h(g, 5, 100) < 75 THEN 'permanent: schema validation failed: field "currency" is required'
    WHEN {{schema}}.bench_h(g, 5, 100) < 90 THEN 'permanent: customer CUS-' || lpad({{schema}}.bench_h(g, 8, 60000)::text, 6, '0') || ' not found'
    WHEN {{schema}}.bench_h(g, 5, 100) < 97 THEN 'permanent: warehouse API refused the reservation (HTTP 409 Conflict: SKU discontinued)'
    ELSE 'group commit gave up after 5 attempts: ERROR: deadlock detected (SQLSTATE 40P01)'
  END END $$;

-- The business id of the p-th parked message: orders are numbered so that
-- one in five is parked twice, by two consumers, seconds apart; the number
-- is scrambled (injective below 10,000,019) to look like an id.
CREATE OR REPLACE FUNCTION {{schema}}.bench_order_id(p bigint) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
SELECT 'ORD-' || lpad((((p * 4 / 5) * 7919) % 10000019)::text, 8, '0') $$;

-- step: inbox records (chunked over N)
-- (Each OFFSET 0 keeps a level's columns computed once per row: without
-- it the planner inlines them into every expression that uses them.)
INSERT INTO {{inbox}} (consumer, message_key, status, attempts, duplicates, lease_until, first_seen_at, processed_at,
  last_error, interrupted, lease_token, interruptions, parked_by_transaction)
SELECT {{schema}}.bench_consumer_name(c), {{schema}}.bench_key(g, {{schema}}.bench_tenant(g, c)), st,
  CASE st WHEN 'done' THEN 1 + (h % 100 < 3)::int WHEN 'failed' THEN 1 + h % 3 WHEN 'processing' THEN 1
    ELSE CASE WHEN interrupted THEN 3 WHEN lease THEN 1 + h % 3 ELSE 1 END END,
  CASE WHEN h % 100 < 4 THEN 1 + h % 3 ELSE 0 END,
  CASE WHEN st = 'processing' THEN '{{anchor}}'::timestamptz + interval '30 seconds' END,
  fs,
  CASE WHEN st = 'processing' THEN NULL WHEN st = 'parked' THEN fs + make_interval(secs => 1 + h % 30)
    ELSE fs + make_interval(secs => 0.02 + (h % 2000) / 1000.0) END,
  CASE st WHEN 'failed' THEN 'upstream timeout: context deadline exceeded' WHEN 'parked' THEN reason END,
  interrupted,
  CASE WHEN lease AND st IN ('processing', 'failed', 'parked') THEN md5('t' || g)::uuid END,
  CASE WHEN interrupted THEN 3 ELSE 0 END,
  st = 'parked' AND NOT lease
FROM (
  SELECT *, CASE
      WHEN parked THEN 'parked'
      WHEN lease AND g > {{N}} - 3000 AND h % 4 = 0 THEN 'processing'
      WHEN lease AND h % 1000 < 15 THEN 'failed'
      ELSE 'done' END AS st,
    parked AND lease AND reason LIKE 'lease expired%' AS interrupted
  FROM (
    SELECT *, {{schema}}.bench_lease(c) AS lease, CASE WHEN parked THEN {{schema}}.bench_reason(g, c) END AS reason
    FROM (
      SELECT g, {{schema}}.bench_c(g) AS c, {{schema}}.bench_h(g, 2, 1000000) AS h, {{schema}}.bench_first_seen(g) AS fs,
        {{schema}}.bench_is_parked(g) AS parked
      FROM generate_series({{lo}}::bigint, {{hi}}::bigint) g OFFSET 0) l1
    OFFSET 0) l2
  OFFSET 0) l3;

-- step: parked messages (chunked over P)
INSERT INTO {{parked}} (consumer, message_key, message_uuid, topic, payload, payload_size, metadata, reason, attempts,
  first_seen_at, parked_at)
SELECT {{schema}}.bench_consumer_name(c), {{schema}}.bench_key(g, tn), {{schema}}.bench_uuid(g),
  (ARRAY['orders.placed', 'orders.paid', 'orders.shipped', 'payments.refund-requested', 'invoices.issued', 'customers.changed',
    'inventory.adjusted', 'tenants.usage'])[c % 8 + 1],
  CASE WHEN h % 1000 < 2 THEN NULL ELSE convert_to(body, 'UTF8') END,
  CASE WHEN h % 1000 < 2 THEN 2097152 + h ELSE octet_length(body) END,
  jsonb_build_object('order_id', oid, 'customer_id', cus, 'event_type',
      (ARRAY['OrderPlaced', 'OrderPaid', 'OrderShipped', 'RefundRequested', 'InvoiceIssued'])[h % 5 + 1],
    'source', (ARRAY['web', 'api', 'batch', 'mobile'])[h % 4 + 1],
    'correlation_id', md5('c' || g)::uuid::text,
    'traceparent', '00-' || md5('t' || g) || '-' || substr(md5('s' || g), 1, 16) || '-01')
    || CASE WHEN tn IS NOT NULL THEN jsonb_build_object('tenant', tn) ELSE '{}'::jsonb END,
  reason,
  CASE WHEN reason LIKE 'lease expired%' THEN 3 WHEN {{schema}}.bench_lease(c) THEN 1 + h % 3 ELSE 1 END,
  fs, fs + make_interval(secs => 1 + h % 30)
FROM (
  SELECT *, '{"order_id":"' || oid || '","customer_id":"' || cus || '","currency":"EUR","amount":"'
      || ((h % 100000) / 100.0)::numeric(10, 2) || '","lines":[' || rtrim(repeat('{"sku":"SKU-' || (1000 + h % 9000) || '","qty":' || (1 + h % 5)
      || ',"price":"' || ((h % 9000) / 100.0)::numeric(10, 2) || '"},', (1 + (h / 7) % 3)::int), ',') || '],"shipping":{"country":"DE","postcode":"'
      || lpad({{schema}}.bench_h(g, 6, 100000)::text, 5, '0') || '"},"note":"'
      || substr(repeat(md5('n' || g), 5), 1, ((h / 11) % 140)::int) || '"}' AS body,
    {{schema}}.bench_tenant(g, c) AS tn, {{schema}}.bench_reason(g, c) AS reason
  FROM (
    SELECT p, g, {{schema}}.bench_c(g) AS c, {{schema}}.bench_h(g, 2, 1000000) AS h, {{schema}}.bench_first_seen(g) AS fs,
      {{schema}}.bench_order_id(p) AS oid, 'CUS-' || lpad({{schema}}.bench_h(g, 8, 60000)::text, 6, '0') AS cus
    FROM (SELECT p, p * {{stride}} AS g FROM generate_series({{lo}}::bigint, {{hi}}::bigint) p) gg OFFSET 0) l1
  OFFSET 0) l2;

-- step: outbox backlog
-- (Quarantined: g <= {{O}}/50; failing: up to {{O}}*3/100; pending after.)
INSERT INTO {{outbox}} (topic, uuid, payload, metadata, created_at, attempts, failures, next_attempt_at, last_error, quarantined_at,
  ordering_key)
SELECT (ARRAY['orders.placed', 'orders.paid', 'invoices.issued', 'notifications.email'])[g % 4 + 1],
  md5('o' || g)::uuid::text,
  convert_to('{"order_id":"ORD-' || lpad(g::text, 8, '0') || '","note":"' || repeat(md5('p' || g), 6) || '"}', 'UTF8'),
  jsonb_build_object('order_id', 'ORD-' || lpad(g::text, 8, '0'), 'traceparent', '00-' || md5('ot' || g) || '-' || substr(md5('os' || g), 1, 16) || '-01')
    || CASE WHEN ok IS NOT NULL THEN jsonb_build_object('ordering_key', ok) ELSE '{}'::jsonb END,
  '{{anchor}}'::timestamptz - make_interval(secs => ({{O}} - g) * 3),
  CASE WHEN q THEN 5 ELSE 0 END,
  CASE WHEN q THEN 5 WHEN f THEN 1 + g % 4 ELSE 0 END,
  CASE WHEN f THEN '{{anchor}}'::timestamptz + make_interval(secs => g % 60) END,
  CASE WHEN q THEN 'PRECONDITION_FAILED - message size 3145728 is larger than configured max size 2097152'
    WHEN f THEN 'publish: NOT_FOUND - no exchange ''notifications'' in vhost ''/''' END,
  CASE WHEN q THEN '{{anchor}}'::timestamptz - make_interval(secs => g * 30) END,
  ok
FROM (
  SELECT g, g <= {{O}}::bigint / 50 AS q, g > {{O}}::bigint / 50 AND g <= {{O}}::bigint * 3 / 100 AS f,
    CASE WHEN g % 2 = 0 THEN 'CUS-' || lpad({{schema}}.bench_h(g, 9, greatest(1, {{O}}::bigint / 8))::text, 6, '0') END AS ok
  FROM generate_series(1, {{O}}::bigint) g) s;

-- step: vacuum analyze inbox
VACUUM (ANALYZE) {{inbox}};
-- step: vacuum analyze parked
VACUUM (ANALYZE) {{parked}};
-- step: vacuum analyze outbox
VACUUM (ANALYZE) {{outbox}};
