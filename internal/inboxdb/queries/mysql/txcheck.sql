-- The check before a COMMIT (txcheck.go). MySQL ends a transaction that
-- lost a deadlock (1213) but not its session: the statements after it run
-- on their own (autocommit), and a COMMIT then succeeds with nothing of the
-- transaction in it. The transaction recorded the key done (the claim's
-- INSERT, or a lease completion's UPDATE): a plain read in it sees its own
-- write; after such a rollback it reads what is committed, where the key
-- is not done (unless another worker's claim of it committed meanwhile:
-- then the key was processed, by that worker). information_schema's
-- innodb_trx is no help: InnoDB refreshes it at most every 0.1 s.

-- name: InTransaction
SELECT count(*) FROM {{.Inbox}} WHERE consumer = ? AND message_key = ? AND status = 'done'

-- name: MarkTx
-- A lease-mode handler's transaction holds no record of the key (its
-- completion writes it last): the check is a savepoint set when it began,
-- released before the completion's statements. After a rollback by the
-- server the savepoint is gone, and its release fails (1305).
SAVEPOINT watermill_exactlyonce_open

-- name: CheckMark
RELEASE SAVEPOINT watermill_exactlyonce_open
