package relay_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/stagedrain/stagedrain/relay"
	"github.com/stagedrain/stagedrain/relay/admin"
	"github.com/stagedrain/stagedrain/relay/internal/testenv"
)

// The leader publishes what backpressure pauses in Redis, for stagedrain
// status: ReadPaused sees the paused queue and its reason, under a short
// TTL that the leader keeps refreshing (and the field rewritten) while the
// pause lasts; once the pause ends the entry is gone.
func TestBackpressurePublished(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	h := newHarness(t)
	db := h.conn.Config().Database
	cfg := h.config()
	cfg.MaxQueueLength, cfg.BatchSize = 10, 5
	h.start(cfg)

	read := func() ([]relay.Paused, error) { return admin.ReadPaused(ctx, h.rdb, h.ns, db, h.schema) }
	waitPaused := func(what string, want []relay.Paused) {
		t.Helper()
		testenv.WaitFor(t, 10*time.Second, what, func() (bool, string) {
			got, err := read()
			if err != nil {
				return false, err.Error()
			}
			return slices.Equal(got, want), fmt.Sprintf("ReadPaused = %v", got)
		})
	}
	key := h.ns + ":stagedrain:" + db + ":" + h.schema + ":paused"

	if p, err := read(); err != nil || p != nil {
		t.Fatalf("ReadPaused before any pause = %v, %v; want nil, nil", p, err)
	}
	h.stageMany(jobsTo("full", 20, "")...)
	h.waitLog("backpressure: pushes paused, jobs wait in PostgreSQL", 1)
	full := []relay.Paused{{Queue: "full", Reason: "queue_length"}}
	waitPaused("the paused queue published", full)
	if ttl := h.rdb.PTTL(ctx, key).Val(); ttl <= 0 || ttl > 10*time.Second {
		t.Fatalf("PTTL %s = %s, want a TTL of at most 10s (a dead relay's pauses expire)", key, ttl)
	}

	// While paused the leader refreshes the TTL, and rewrites its fields.
	if err := h.rdb.PExpire(ctx, key, time.Hour).Err(); err != nil {
		t.Fatal(err)
	}
	testenv.WaitFor(t, 10*time.Second, "the TTL refreshed to at most 10s", func() (bool, string) {
		ttl := h.rdb.PTTL(ctx, key).Val()
		return ttl > 0 && ttl <= 10*time.Second, fmt.Sprintf("PTTL %s", ttl)
	})
	if err := h.rdb.HDel(ctx, key, "full").Err(); err != nil {
		t.Fatal(err)
	}
	waitPaused("the field rewritten", full)

	// The consumer empties the queue: the pause ends, and its entry goes.
	for {
		if _, err := h.rdb.RPop(ctx, h.key("queue:full")).Result(); errors.Is(err, redis.Nil) {
			break
		} else if err != nil {
			t.Fatal(err)
		}
	}
	h.waitLog("backpressure: pushes resumed", 1)
	waitPaused("no paused queue published", nil)
	if n := h.rdb.Exists(ctx, key).Val(); n != 0 {
		t.Fatalf("%s still exists after the pause ended", key)
	}
}
