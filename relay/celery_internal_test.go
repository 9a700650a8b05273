package relay

import (
	"errors"
	"testing"

	"github.com/redis/go-redis/v9"
)

// Validate refuses the celery target on a Redis Cluster client, and
// --timestamp-format millis with it.
func TestValidateCelery(t *testing.T) {
	t.Parallel()
	base := Config{DatabaseURL: "postgres://127.0.0.1/test", Redis: redis.NewClient(&redis.Options{}), Target: TargetCelery}.WithDefaults()
	cluster := redis.NewClusterClient(&redis.ClusterOptions{Addrs: []string{"127.0.0.1:1"}})
	t.Cleanup(func() { _ = base.Redis.Close(); _ = cluster.Close() })
	for _, tc := range []struct {
		name  string
		edit  func(*Config)
		field string
	}{
		{"plain", func(*Config) {}, ""},
		{"namespace", func(c *Config) { c.RedisNamespace = "myapp" }, ""},
		{"cluster", func(c *Config) { c.Redis = cluster }, "Redis"},
		{"millis", func(c *Config) { c.TimestampFormat = TimestampMillis }, "TimestampFormat"},
		{"tenant key a header", func(c *Config) { c.TenantKey = "root_id" }, "TenantKey"},
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
