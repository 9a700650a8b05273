package relay_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/stagedrain/stagedrain/relay"
	"github.com/stagedrain/stagedrain/relay/internal/testenv"
)

// Redis down when the relay starts (it waits before leading), and again
// mid-run: rows stay staged, failures are logged and retried, and
// everything drains when Redis is back.
func TestRedisDownAtStartAndMidRun(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	srv := testenv.StartRedis(t)
	srv.Stop() // down at start
	rdb := redis.NewClient(testenv.RedisOptions(&redis.Options{Addr: fmt.Sprintf("127.0.0.1:%d", srv.Port)}))
	t.Cleanup(func() { _ = rdb.Close() })
	h.rdb = rdb

	cfg := h.config()
	cfg.Redis = rdb
	h.start(cfg)

	first := []string{h.stage(relay.Job{Name: "A"}), h.stage(relay.Job{Name: "B"})}
	// The relay waits for Redis before it campaigns to lead.
	h.waitLog("redis unreachable, retrying", 2)
	if n := h.staged(); n != 2 {
		t.Fatalf("%d rows staged while Redis is down, want 2", n)
	}
	if n := h.logs.FilterMessage("became leader").Len(); n != 0 {
		t.Fatalf("the relay became leader while Redis was unreachable")
	}

	srv.Start()
	h.waitQueueLen("default", 2, 15*time.Second)
	h.waitStaged(0)

	// Down again mid-run.
	srv.Stop()
	failures := h.logs.FilterMessage("batch failed, retrying").Len()
	second := h.stage(relay.Job{Name: "C"})
	h.waitLog("batch failed, retrying", failures+2)
	if n := h.staged(); n != 1 {
		t.Fatalf("%d rows staged while Redis is down mid-run, want 1", n)
	}
	srv.Start() // a fresh, empty Redis: only C is to come
	h.waitQueueLen("default", 1, 15*time.Second)
	if got := h.queue("default")[0].jid(); got != second {
		t.Fatalf("after restart delivered %s, want %s (first batch was %v)", got, second, first)
	}
	h.waitStaged(0)
	// A push that failed is settled under a new token: the relay took the
	// fence of the fresh Redis (its first epoch) before it pushed C.
	fence, _ := h.handoffKeys()
	if epoch, err := rdb.HGet(context.Background(), fence, "epoch").Int(); err != nil || epoch != 1 {
		t.Fatalf("fresh Redis's fence epoch = %d, %v; want 1, taken after the failed push", epoch, err)
	}
}
