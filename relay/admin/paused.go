package admin

import (
	"context"
	"fmt"
	"slices"
	"strings"

	"github.com/redis/go-redis/v9"

	"github.com/stagedrain/stagedrain/relay"
	"github.com/stagedrain/stagedrain/relay/internal/keys"
)

// ReadPaused returns what the leaders of a schema's relays pause now for
// backpressure, sorted by queue (nil when nothing is), as they publish it
// in Redis: the relays' namespace (relay.Config.RedisNamespace), the
// database they drain (its name, as in the database URL) and the schema. A
// relay that died or stopped leading drops out within about ten seconds.
// stagedrain status --redis-url shows it; a relay's own Status().Paused is
// the same list, for that relay.
func ReadPaused(ctx context.Context, rdb redis.Cmdable, namespace, database, schema string) ([]relay.Paused, error) {
	key := keys.Paused(namespace, database, schema)
	m, err := rdb.HGetAll(ctx, key).Result()
	if err != nil {
		return nil, fmt.Errorf("read the paused queues (%s): %w", key, err)
	}
	var p []relay.Paused
	for q, reason := range m {
		p = append(p, relay.Paused{Queue: q, Reason: reason})
	}
	slices.SortFunc(p, func(a, b relay.Paused) int { return strings.Compare(a.Queue, b.Queue) })
	return p, nil
}
