package main

import (
	"context"
	"database/sql"
	"fmt"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	_ "github.com/go-sql-driver/mysql"

	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

func main() {
	db, err := sql.Open("mysql", "root@tcp(127.0.0.1:3306)/test?parseTime=true")
	if err != nil {
		panic(err)
	}
	ctx := context.Background()
	cfg := sqlschema.DB{Conn: wsql.BeginnerFromStdSQL(db), Dialect: sqlschema.MySQL, Schema: "eo_scratch"}
	fmt.Println("migrate:", sqlschema.Migrate(ctx, cfg))
	fmt.Println("migrate again:", sqlschema.Migrate(ctx, cfg))
	fmt.Println("check:", sqlschema.Check(ctx, cfg))
	st, err := sqlschema.Status(ctx, cfg)
	fmt.Println("status:", st, err)
	fmt.Println("pg dialect:", sqlschema.Check(ctx, sqlschema.DB{Conn: wsql.BeginnerFromStdSQL(db)}))
	fmt.Println("partitions:", sqlschema.Check(ctx, sqlschema.DB{Conn: wsql.BeginnerFromStdSQL(db), Dialect: sqlschema.MySQL, Partitions: &sqlschema.Partitioning{}}))
	db2, _ := sql.Open("mysql", "root@tcp(127.0.0.1:3306)/test")
	fmt.Println("no parseTime:", sqlschema.Check(ctx, sqlschema.DB{Conn: wsql.BeginnerFromStdSQL(db2), Dialect: sqlschema.MySQL, Schema: "eo_scratch"}))
	s, err := sqlschema.SQL(sqlschema.DB{Dialect: sqlschema.MySQL})
	fmt.Println(len(s), err)
	_, err = db.Exec("DROP DATABASE eo_scratch")
	fmt.Println(err)
}
