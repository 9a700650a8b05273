package relay

import (
	"crypto/tls"
	"strings"
	"testing"

	"github.com/redis/go-redis/v9"
)

// A rediss:// URL is TLS (1.2 or later, the certificate checked against the
// URL's host unless skip_verify=true), and the relay describes its target
// as it does redis://'s, never with the password.
func TestRedissURL(t *testing.T) {
	const password = "s3cret-redis-pw"
	for _, tc := range []struct {
		url, describe, serverName string
		skipVerify                bool
	}{
		{"rediss://:" + password + "@127.0.0.1:6380/2", "127.0.0.1:6380/2", "127.0.0.1", false},
		{"rediss://app:" + password + "@redis.internal/0", "redis.internal:6379/0", "redis.internal", false},
		{"rediss://default:" + password + "@[::1]:6390/1?skip_verify=true", "[::1]:6390/1", "::1", true},
		{"redis://:" + password + "@127.0.0.1:6379/3", "127.0.0.1:6379/3", "", false},
	} {
		o, err := redis.ParseURL(tc.url)
		if err != nil {
			t.Fatalf("ParseURL(%s): %v", tc.url, err)
		}
		switch {
		case o.Password != password:
			t.Errorf("%s: password %q, want %q", tc.url, o.Password, password)
		case tc.serverName == "" && o.TLSConfig != nil:
			t.Errorf("%s: TLS config %+v, want none", tc.url, o.TLSConfig)
		case tc.serverName != "" && (o.TLSConfig == nil || o.TLSConfig.ServerName != tc.serverName ||
			o.TLSConfig.MinVersion != tls.VersionTLS12 || o.TLSConfig.InsecureSkipVerify != tc.skipVerify):
			t.Errorf("%s: TLS config %+v, want ServerName %q, MinVersion TLS 1.2, InsecureSkipVerify %v",
				tc.url, o.TLSConfig, tc.serverName, tc.skipVerify)
		}
		rdb := redis.NewClient(noMaintNotifications(o))
		if got := DescribeRedis(rdb); got != tc.describe || strings.Contains(got, password) {
			t.Errorf("DescribeRedis(%s) = %q, want %q", tc.url, got, tc.describe)
		}
		rdb.Close()
	}
}

// A URL of another scheme than postgres or postgresql (a typo) is named as
// such, by CheckDatabaseURL and Config.Validate, without its password; a
// keyword/value string is not taken for a URL.
func TestCheckDatabaseURLScheme(t *testing.T) {
	const password = "s3cret-pg-pw"
	for _, u := range []string{"postgress://u:" + password + "@h/db", "POSTGRES://u:" + password + "@h/db", " pg://u:" + password + "@h/db"} {
		err := CheckDatabaseURL(u)
		if err == nil || !strings.Contains(err.Error(), "unknown URL scheme") ||
			!strings.Contains(err.Error(), "want postgres://user:password@host:port/db or postgresql://") || strings.Contains(err.Error(), password) {
			t.Errorf("CheckDatabaseURL(%q) = %v, want an unknown URL scheme naming the form, without the password", u, err)
		}
		cfg := Config{DatabaseURL: u, Redis: redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"})}
		if err := cfg.WithDefaults().Validate(); err == nil || !strings.Contains(err.Error(), "unknown URL scheme") || strings.Contains(err.Error(), password) {
			t.Errorf("Config{DatabaseURL: %q}.WithDefaults().Validate() = %v, want an unknown URL scheme, without the password", u, err)
		}
		cfg.Redis.Close()
	}
	for _, u := range []string{"postgres://u:" + password + "@h/db", "postgresql://h/db", "host=h user=u password=" + password + " options='-c x=a://b'"} {
		if err := CheckDatabaseURL(u); err != nil {
			t.Errorf("CheckDatabaseURL(%q) = %v, want nil", u, err)
		}
	}
}
