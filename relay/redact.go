package relay

import (
	"errors"
	"fmt"
	"net"
	"net/url"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// redactErr removes the connection string from a connection-string parse
// error: pgx's own redaction is best effort, ours is to leave the string out.
func redactErr(err error) error {
	var pce *pgconn.ParseConfigError
	if errors.As(err, &pce) {
		msg := pce.Error()
		if i := strings.LastIndex(msg, "`: "); i >= 0 {
			return errors.New("cannot parse connection string: " + msg[i+3:])
		}
		return errors.New("cannot parse connection string")
	}
	var ue *url.Error
	if errors.As(err, &ue) {
		return fmt.Errorf("cannot parse URL: %w", ue.Err)
	}
	return err
}

// DescribeDatabase returns user@host:port/database for a PostgreSQL
// connection string, without its password, for log lines.
func DescribeDatabase(connString string) string {
	cfg, err := pgx.ParseConfig(connString)
	if err != nil {
		return "(unparsable)"
	}
	return fmt.Sprintf("%s@%s/%s", cfg.User, net.JoinHostPort(cfg.Host, strconv.Itoa(int(cfg.Port))), cfg.Database)
}

// CheckDatabaseURL reports whether connString parses, with an error that
// never contains the string itself.
func CheckDatabaseURL(connString string) error {
	if _, err := pgx.ParseConfig(connString); err != nil {
		return redactErr(err)
	}
	return nil
}
