package relay

import (
	"net/url"
	"strings"
	"testing"

	"github.com/redis/go-redis/v9"
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
		if len(password) < 6 || strings.Contains(query, password) {
			return // too short to tell a leak from a coincidence
		}
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

// DescribeRedis names a client's target as host:port/db and never its
// password or user name's secret.
func FuzzDescribeRedisNeverShowsPassword(f *testing.F) {
	f.Add("s3cret-pw", "127.0.0.1:6379", 3)
	f.Add("p@ss:word", "[::1]:6380", 0)
	f.Fuzz(func(t *testing.T, password, addr string, db int) {
		if len(password) < 6 || strings.Contains(addr, password) {
			return // too short to tell a leak from a coincidence
		}
		rdb := redis.NewClient(&redis.Options{Addr: addr, Password: password, DB: db})
		defer rdb.Close()
		if s := DescribeRedis(rdb); strings.Contains(s, password) {
			t.Fatalf("DescribeRedis = %q shows the password", s)
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
