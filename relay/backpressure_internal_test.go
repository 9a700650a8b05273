package relay

import (
	"errors"
	"strings"
	"testing"

	"github.com/redis/go-redis/v9"
)

// Validate refuses a negative MaxQueueLength, a RedisMaxMemoryRatio outside
// 0-1, and a ratio with a Redis Cluster client.
func TestValidateBackpressure(t *testing.T) {
	t.Parallel()
	base := Config{DatabaseURL: "postgres://127.0.0.1/test", Redis: redis.NewClient(&redis.Options{})}.WithDefaults()
	cluster := redis.NewClusterClient(&redis.ClusterOptions{Addrs: []string{"127.0.0.1:1"}})
	t.Cleanup(func() { _ = base.Redis.Close(); _ = cluster.Close() })
	for _, tc := range []struct {
		name  string
		edit  func(*Config)
		field string // "" valid
	}{
		{"off", func(*Config) {}, ""},
		{"on", func(c *Config) { c.MaxQueueLength, c.RedisMaxMemoryRatio = 1000, 0.8 }, ""},
		{"negative length", func(c *Config) { c.MaxQueueLength = -1 }, "MaxQueueLength"},
		{"ratio above 1", func(c *Config) { c.RedisMaxMemoryRatio = 1.5 }, "RedisMaxMemoryRatio"},
		{"negative ratio", func(c *Config) { c.RedisMaxMemoryRatio = -0.1 }, "RedisMaxMemoryRatio"},
		{"ratio on a cluster", func(c *Config) { c.Target, c.Redis, c.RedisMaxMemoryRatio = TargetStreams, cluster, 0.5 }, "RedisMaxMemoryRatio"},
	} {
		c := base
		tc.edit(&c)
		err := c.Validate()
		var fe *FieldError
		switch {
		case tc.field == "" && err != nil:
			t.Errorf("%s: %v, want valid", tc.name, err)
		case tc.field != "" && (!errors.As(err, &fe) || fe.Field != tc.field):
			t.Errorf("%s: %v, want a FieldError on %s", tc.name, err, tc.field)
		}
	}
}

// checkStreamLag's refusal: Redis before 7.0 reports no lag; a version it
// cannot read is taken as it is.
func TestStreamLagSupported(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		info   string
		refuse bool
	}{
		{"# Server\r\nredis_version:6.2.14\r\nredis_mode:standalone\r\n", true},
		{"redis_version:5.0.7\r\n", true},
		{"redis_version:7.0.15\r\n", false},
		{"redis_version:8.2.1\r\n", false},
		{"redis_version:\r\n", false},
		{"", false},
	} {
		err := streamLagSupported(tc.info, "127.0.0.1:6379")
		switch {
		case tc.refuse && (err == nil || strings.Contains(err.Error(), "\n") ||
			!strings.Contains(err.Error(), "needs Redis 7.0 or later") || !strings.Contains(err.Error(), "127.0.0.1:6379 is version ")):
			t.Errorf("%q: %v, want one line that names the server, its version and 7.0", tc.info, err)
		case !tc.refuse && err != nil:
			t.Errorf("%q: %v, want nil", tc.info, err)
		}
	}
}
