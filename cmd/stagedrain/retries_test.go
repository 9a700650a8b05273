package main

import (
	"testing"

	"github.com/redis/go-redis/v9"
)

// run's Redis client never resends a command on its own, whatever the URL
// asks (max_retries=5): a resent push could run twice while the first copy
// is still on its way. In every --redis-mode; a cluster client also
// resends on MaxRedirects, which is off too. go-redis turns -1 into 0
// ("no retries") when it builds a client of one server; a cluster
// client keeps -1 and passes it to its nodes.
func TestRunRedisClientNeverRetries(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ mode, url string }{
		{"single", "redis://127.0.0.1:1/0?max_retries=5"},
		{"cluster", "redis://127.0.0.1:1?addr=127.0.0.1:2&max_retries=5&max_redirects=5"},
		{"sentinel", "redis://127.0.0.1:1/0?master_name=m&max_retries=5"},
	} {
		f, c := newRunFlags()
		c.redisMode, c.redisURL, c.target = tc.mode, tc.url, "streams"
		newClient, err := c.redisClient(f)
		if err != nil {
			t.Fatalf("%s: %v", tc.mode, err)
		}
		rdb := newClient()
		switch r := rdb.(type) {
		case *redis.Client:
			if o := r.Options(); o.MaxRetries != 0 {
				t.Errorf("%s: MaxRetries %d, want 0 (none)", tc.mode, o.MaxRetries)
			}
		case *redis.ClusterClient:
			if o := r.Options(); o.MaxRetries > 0 || o.MaxRedirects != 0 {
				t.Errorf("%s: MaxRetries %d, MaxRedirects %d; want none of either (-1 or 0)", tc.mode, o.MaxRetries, o.MaxRedirects)
			}
		default:
			t.Fatalf("%s: client %T", tc.mode, rdb)
		}
		_ = rdb.Close()
	}
}
