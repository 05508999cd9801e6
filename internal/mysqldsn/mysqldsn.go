// Package mysqldsn turns a mysql:// URL (the form the CLI, the examples and
// the tests take in $MYSQL_URL or --database-url) into a
// go-sql-driver/mysql DSN with what the library needs: parseTime=true
// (DATETIME columns scanned into time.Time) and loc=UTC.
package mysqldsn

import (
	"fmt"
	"net"
	"net/url"
	"strings"
)

// IsURL reports whether s is a mysql:// URL.
func IsURL(s string) bool { return strings.HasPrefix(s, "mysql://") }

// FromURL converts mysql://user:password@host:port/database?params into
// user:password@tcp(host:port)/database?params. The URL's query parameters
// are kept (go-sql-driver's own, or system variables to SET); parseTime=true
// and loc=UTC are added unless the URL sets them. The port defaults to 3306,
// the host to localhost.
func FromURL(rawURL string) (string, error) {
	u, err := url.Parse(rawURL)
	if err != nil {
		return "", fmt.Errorf("invalid MySQL URL: %w", err)
	}
	if u.Scheme != "mysql" {
		return "", fmt.Errorf("invalid MySQL URL: the scheme is %q, not mysql", u.Scheme)
	}
	host, port := u.Hostname(), u.Port()
	if host == "" {
		host = "localhost"
	}
	if port == "" {
		port = "3306"
	}
	var auth string
	if u.User != nil {
		auth = u.User.Username()
		if p, ok := u.User.Password(); ok {
			auth += ":" + p
		}
		auth += "@"
	}
	q := u.Query()
	if !q.Has("parseTime") {
		q.Set("parseTime", "true")
	}
	if !q.Has("loc") {
		q.Set("loc", "UTC")
	}
	return auth + "tcp(" + net.JoinHostPort(host, port) + ")/" + strings.TrimPrefix(u.EscapedPath(), "/") + "?" + q.Encode(), nil
}
