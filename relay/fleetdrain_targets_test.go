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

// A hot fleet's shared drain, with each target: for those with a
// scheduler of their own (asynq, bullmq; sidekiq in the tests above) the
// schemas one poll finds are drained in one transaction, each through its
// target's own push; for those without (streams, celery), which arm a
// wake-up for the next run_at after each drain, the shared drain never
// takes a batch, and each schema drains on its own. Either way every job
// of a transaction that stages one in each of three schemas is delivered
// once.
func TestFleetHotSharedDrainEveryTarget(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		target relay.Target
		shared bool
	}{
		{relay.TargetAsynq, true},
		{relay.TargetBullMQ, true},
		{relay.TargetStreams, false},
		{relay.TargetCelery, false},
	} {
		t.Run(string(tc.target), func(t *testing.T) {
			t.Parallel()
			testFleetHotSharedDrainTarget(t, tc.target, tc.shared)
		})
	}
}

func testFleetHotSharedDrainTarget(t *testing.T, target relay.Target, shared bool) {
	ctx := context.Background()
	fh := newFleetHarness(t, 3)
	cfg := fh.fleetConfig()
	cfg.Target = target
	cfg.PollInterval = time.Hour // only the hot poll finds what does not notify
	rdb := fh.rdb
	if target == relay.TargetAsynq {
		// asynq's key names are fixed (no namespace): a Redis of its own.
		srv := testenv.StartRedis(t)
		opts, _ := redis.ParseURL(srv.URL())
		c := redis.NewClient(testenv.RedisOptions(opts))
		t.Cleanup(func() { _ = c.Close() })
		rdb, cfg.Redis, cfg.RedisNamespace = c, c, ""
	}
	r, err := relay.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	relay.SetFleetHotLeave(r, 0)
	relay.SetFleetHotOnRate(r)
	q := testenv.Name("hot")
	fh.run(r)
	fh.waitLeadsAll(r)
	bc := commitBusy(t, fh.schemas)
	defer bc.stop()
	testenv.WaitFor(t, 30*time.Second, "the fleet hot", func() (bool, string) {
		return relay.FleetHot(r), "not hot"
	})
	entries := func() int64 {
		var n int64
		var err error
		switch target {
		case relay.TargetAsynq:
			n, err = rdb.LLen(ctx, "asynq:{"+q+"}:pending").Result()
		case relay.TargetBullMQ:
			n, err = fh.rdb.LLen(ctx, fh.key(q+":wait")).Result()
		case relay.TargetStreams:
			n, err = fh.rdb.XLen(ctx, fh.key("stream:"+q)).Result()
		case relay.TargetCelery:
			n, err = fh.rdb.LLen(ctx, fh.key(q)).Result()
		}
		if err != nil && err != redis.Nil {
			t.Fatalf("count %s's entries of queue %s: %v", target, q, err)
		}
		return n
	}
	_, batches0 := sharedCounters(t, r)
	var want int64
	for run := range 5 {
		fh.stageAcross(ctx, fh.schemas, q)
		want += int64(len(fh.schemas))
		testenv.WaitFor(t, 15*time.Second, fmt.Sprintf("run %d's jobs delivered", run), func() (bool, string) {
			n := entries()
			return n >= want, fmt.Sprintf("%d of %d entries", n, want)
		})
		if c, b := sharedCounters(t, r); shared && c >= 1 && b-batches0 > float64(run+1) {
			break // more batches than runs: some took several schemas
		}
	}
	if !relay.FleetHot(r) {
		t.Fatal("the fleet cooled: its schemas' drains, not the hot poll's, may have delivered")
	}
	for _, schema := range fh.schemas {
		testenv.WaitFor(t, 15*time.Second, schema+" drained of queue "+q, func() (bool, string) {
			var n int
			if err := fh.conn.QueryRow(ctx, fmt.Sprintf(`SELECT count(*) FROM %q.staged_jobs WHERE queue = $1`, schema), q).Scan(&n); err != nil {
				return false, err.Error()
			}
			return n == 0, fmt.Sprintf("%d rows", n)
		})
	}
	if n := entries(); n != want {
		t.Fatalf("queue %s holds %d entries, want %d: each job once", q, n, want)
	}
	_, batches := sharedCounters(t, r)
	switch {
	case shared && batches == batches0:
		t.Fatalf("no shared drain took a batch with the %s target", target)
	case !shared && batches != 0:
		t.Fatalf("shared drains took %v batches with the %s target, which has no scheduler: its drains arm the wake-up for run_at", batches, target)
	}
}
