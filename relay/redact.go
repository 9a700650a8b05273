package relay

import (
	"errors"
	"fmt"
	"net"
	"net/url"
	"regexp"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/redis/go-redis/v9"
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

// urlScheme matches the scheme of a URL: a keyword/value connection string
// ("host=... user=...") cannot start so, as "=" is not a scheme's.
var urlScheme = regexp.MustCompile(`^\s*([A-Za-z][A-Za-z0-9+.-]*)://`)

// keywordValue matches the start of a keyword/value connection string:
// "host=...", "dbname = ...".
var keywordValue = regexp.MustCompile(`^\s*[A-Za-z_]+\s*=`)

// CheckDatabaseURL reports whether connString parses, with an error that
// never contains the string itself. A URL of any scheme but postgres or
// postgresql (a typo such as postgress://) is named as such: pgx would read
// it as a keyword/value string and say only that it is not one.
func CheckDatabaseURL(connString string) error {
	m := urlScheme.FindStringSubmatch(connString)
	if m != nil && m[1] != "postgres" && m[1] != "postgresql" { // pgx, too, reads only these, in lower case
		return fmt.Errorf("unknown URL scheme %q: want postgres://user:password@host:port/db or postgresql://user:password@host:port/db "+
			"(or a keyword/value string: host=... user=... dbname=...)", m[1])
	}
	// Neither a URL nor keyword/value (user@host:5432/db, host:5432/db):
	// pgx would say only that it is not keyword/value.
	if m == nil && strings.TrimSpace(connString) != "" && !keywordValue.MatchString(connString) {
		return errors.New("not a URL (no postgres:// scheme) nor a keyword/value string: want a URL like postgres://user:password@host:5432/db " +
			"(or host=... user=... dbname=...)")
	}
	if _, err := pgx.ParseConfig(connString); err != nil {
		return redactErr(err)
	}
	return nil
}

// DescribeRedis returns host:port/db for the server behind rdb, without its
// user or password, for log lines and errors: the address and DB of a
// *redis.Client, "sentinel primary/<db>" for a Sentinel FailoverClient, the
// seed addresses of a *redis.ClusterClient.
func DescribeRedis(rdb redis.UniversalClient) string {
	switch c := rdb.(type) {
	case *redis.Client:
		o := c.Options()
		if o.Addr == "FailoverClient" { // redis.NewFailoverClient: Sentinel finds the primary
			return fmt.Sprintf("sentinel primary/%d", o.DB)
		}
		if o.Network == "unix" {
			return fmt.Sprintf("unix:%s/%d", o.Addr, o.DB)
		}
		return fmt.Sprintf("%s/%d", o.Addr, o.DB)
	case *redis.ClusterClient:
		return "cluster " + strings.Join(c.Options().Addrs, ",")
	default:
		return fmt.Sprintf("(%T)", rdb)
	}
}

// isRedisRefusal reports whether err carries Redis's refusal of the
// connection's credentials or DB: waiting will not fix it, an operator
// must. Redis answers an unknown user or a wrong password with WRONGPASS
// (before 6.0, "ERR invalid password"), a missing one with NOAUTH, and a
// SELECT of a DB it does not have with "ERR DB index is out of range".
func isRedisRefusal(err error) bool {
	var re redis.Error
	if !errors.As(err, &re) {
		return false
	}
	msg := re.Error()
	for _, prefix := range []string{"WRONGPASS", "NOAUTH"} {
		if strings.HasPrefix(msg, prefix) {
			return true
		}
	}
	for _, s := range []string{
		"DB index is out of range",
		"invalid DB index",
		"invalid password",
		"without any password configured", // AUTH with a password, server has none (6.0+)
		"no password is set",              // the same before 6.0
	} {
		if strings.Contains(msg, s) {
			return true
		}
	}
	return false
}
