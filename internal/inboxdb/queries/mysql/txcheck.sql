-- The check before a COMMIT (txcheck.go). MySQL ends a transaction that
-- lost a deadlock (1213) but not its session: the statements after it run
-- on their own (autocommit), and a COMMIT then succeeds with nothing of the
-- transaction in it. The claim's INSERT gave the transaction an InnoDB
-- transaction of this connection: none left means the server rolled it
-- back.
--
-- MariaDB answers from its session (@@in_transaction, in the /*M! */
-- comment only MariaDB executes). information_schema.innodb_trx, the other
-- flavours' answer, is served from a cache InnoDB refreshes only when more
-- than 0.1 s passed since it was last read: right after a deadlock it may
-- still list the rolled-back transaction, and it may not list one begun a
-- moment ago. MySQL 8 has no @@in_transaction; its check keeps that flaw.

-- name: InTransaction
SELECT COALESCE(/*M! @@in_transaction, */ (SELECT count(*) FROM information_schema.innodb_trx WHERE trx_mysql_thread_id = connection_id()))
