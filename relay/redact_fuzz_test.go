package relay

import (
	"cmp"
	"net/url"
	"strings"
	"testing"

	"github.com/redis/go-redis/v9"
	"github.com/redis/go-redis/v9/maintnotifications"
)

// Whatever else a connection string holds, its password never shows in what
// the relay says of it: DescribeDatabase, CheckDatabaseURL's error, or the
// error of Config.Validate (which the CLI prints).
func FuzzDatabaseURLNeverShowsPassword(f *testing.F) {
	f.Add("s3cret-pw", "sslmode=disable")
	f.Add("p@ss:word/with?odd#chars", "sslmode=bogus")
	f.Add("pässwörd", "connect_timeout=x")
	f.Add("hunter22", "application_name=x&target_session_attrs=nonsense")
	rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"}) // never dialled
	defer rdb.Close()
	f.Fuzz(func(t *testing.T, password, query string) {
		if len(password) < 6 || strings.Contains(query, pwMark) {
			return // too short to tell a leak from a coincidence
		}
		password = pwMark + password
		if q := strings.ToLower(query); strings.Contains(q, "ssl") || strings.Contains(q, "file") || strings.Contains(q, "service") {
			return // parameters that make pgx read files (/dev/zero reads forever)
		}
		u := url.URL{Scheme: "postgres", User: url.UserPassword("user", password),
			Host: "127.0.0.1:5432", Path: "/db", RawQuery: query}
		escaped := strings.ReplaceAll(strings.ReplaceAll(password, `\`, `\\`), `'`, `\'`)
		for _, conn := range []string{
			u.String(),
			"host=127.0.0.1 user=user password='" + escaped + "' dbname=db " + query,
		} {
			says := []string{DescribeDatabase(conn)}
			if err := CheckDatabaseURL(conn); err != nil {
				says = append(says, err.Error())
			}
			if err := (Config{DatabaseURL: conn, Redis: rdb}).WithDefaults().Validate(); err != nil {
				says = append(says, err.Error())
			}
			for _, s := range says {
				if strings.Contains(s, password) || strings.Contains(s, url.QueryEscape(password)) || strings.Contains(s, url.PathEscape(password)) {
					t.Fatalf("the password shows in %q (connection string %q)", s, conn)
				}
			}
		}
	})
}

// pwMark starts every fuzzed password, so that what shows it can be told
// from a message that quotes the rest of the input (pgx quoting a query
// parameter "00000" against the password 00000"): an input holding pwMark
// outside the password is passed over.
const pwMark = "pw~"

// noMaintNotifications keeps redis.NewClient from resolving the client's
// host name as it builds the client (go-redis does, to pick an endpoint
// type for maintenance notifications): with fuzzed host names and no DNS
// server to answer, each lookup waits for its timeout (up to 2s), and a
// fuzz run stalls at 0 execs/s.
func noMaintNotifications(o *redis.Options) *redis.Options {
	o.MaintNotificationsConfig = &maintnotifications.Config{Mode: maintnotifications.ModeDisabled}
	return o
}

// DescribeRedis names a client's target as host:port/db and never its
// password or user name's secret.
func FuzzDescribeRedisNeverShowsPassword(f *testing.F) {
	f.Add("s3cret-pw", "127.0.0.1:6379", 3)
	f.Add("p@ss:word", "[::1]:6380", 0)
	f.Add("hunter22", "redis.internal:6380", 1)
	f.Fuzz(func(t *testing.T, password, addr string, db int) {
		if len(password) < 6 || strings.Contains(addr, pwMark) {
			return // too short to tell a leak from a coincidence
		}
		password = pwMark + password
		rdb := redis.NewClient(noMaintNotifications(&redis.Options{Addr: addr, Password: password, DB: db}))
		defer rdb.Close()
		if s := DescribeRedis(rdb); strings.Contains(s, password) {
			t.Fatalf("DescribeRedis = %q shows the password", s)
		}
	})
}

// A redis:// or rediss:// URL that go-redis parses is described without its
// password, and rediss:// always means TLS with the certificate checked
// against the URL's host (unless skip_verify says otherwise).
func FuzzRedisURLNeverShowsPassword(f *testing.F) {
	f.Add("s3cret-pw", "user", "127.0.0.1:6380", "/2", "", true)
	f.Add("p@ss:word/x", "", "redis.internal", "", "skip_verify=true", true)
	f.Add("hunter22", "default", "[::1]:6379", "/0", "dial_timeout=3s&db=4", false)
	f.Fuzz(func(t *testing.T, password, user, host, path, query string, tls bool) {
		if len(password) < 6 || strings.Contains(user+host+path+query, pwMark) {
			return // too short to tell a leak from a coincidence
		}
		password = pwMark + password
		u := url.URL{Scheme: "redis", User: url.UserPassword(user, password), Host: host, Path: path, RawQuery: query}
		if tls {
			u.Scheme = "rediss"
		}
		o, err := redis.ParseURL(u.String())
		if err != nil {
			return // the CLI says only that it cannot be parsed
		}
		if o.Password != password {
			return // a host with an @ moved the end of the user info: another URL
		}
		if tls != (o.TLSConfig != nil) {
			t.Fatalf("ParseURL(%q): TLSConfig %v, want TLS %v", u.String(), o.TLSConfig, tls)
		}
		if tls && !o.TLSConfig.InsecureSkipVerify {
			pu, _ := url.Parse(u.String()) // as ParseURL read it
			want := cmp.Or(pu.Hostname(), "localhost")
			if o.TLSConfig.ServerName != want {
				t.Fatalf("ParseURL(%q): TLS checks the certificate for %q, want %q", u.String(), o.TLSConfig.ServerName, want)
			}
		}
		// The parsed target; not its pool options (min_idle_conns would dial).
		rdb := redis.NewClient(noMaintNotifications(&redis.Options{Network: o.Network, Addr: o.Addr, DB: o.DB,
			Username: o.Username, Password: o.Password, TLSConfig: o.TLSConfig}))
		defer rdb.Close()
		if s := DescribeRedis(rdb); strings.Contains(s, password) || strings.Contains(s, url.QueryEscape(password)) {
			t.Fatalf("DescribeRedis = %q shows the password of %q", s, u.String())
		}
	})
}

// DescribeRedis names a cluster by its seed addresses and a Sentinel
// client as "sentinel primary/<db>", without the passwords of their URLs.
func TestDescribeRedisClusterAndSentinel(t *testing.T) {
	const password = "s3cret-pw"
	co, err := redis.ParseClusterURL("redis://u:" + password + "@10.0.0.1:7000?addr=10.0.0.2:7001")
	if err != nil {
		t.Fatal(err)
	}
	cluster := redis.NewClusterClient(co)
	defer cluster.Close()
	fo, err := redis.ParseFailoverURL("redis://u:" + password + "@10.0.0.1:26379/2?master_name=mymaster&password=" + password)
	if err != nil {
		t.Fatal(err)
	}
	sentinel := redis.NewFailoverClient(fo)
	defer sentinel.Close()
	for rdb, want := range map[redis.UniversalClient]string{
		cluster:  "cluster 10.0.0.1:7000,10.0.0.2:7001",
		sentinel: "sentinel primary/2",
	} {
		if got := DescribeRedis(rdb); got != want || strings.Contains(got, password) {
			t.Errorf("DescribeRedis = %q, want %q", got, want)
		}
	}
}
