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
