-- The check before a COMMIT (txcheck.go). MySQL ends a transaction that
-- lost a deadlock (1213) but not its session: the statements after it run
-- on their own (autocommit), and a COMMIT then succeeds with nothing of the
-- transaction in it. The claim's INSERT gave the transaction an InnoDB
-- transaction of this connection: none left means the server rolled it
-- back.

-- name: InTransaction
SELECT count(*) FROM information_schema.innodb_trx WHERE trx_mysql_thread_id = connection_id()
