package relay_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/stagedrain/stagedrain/relay"
	"github.com/stagedrain/stagedrain/relay/internal/testenv"
)

// Redis frozen (SIGSTOP) for longer than the client's read timeout while a
// batch's push is on its way: the client gives up on its reply and, with
// go-redis's default MaxRetries (3), sends the push again on new
// connections, which the frozen server accepts and buffers. On SIGCONT
// Redis runs every copy. Each job must reach its queue once: the copies
// after the first find the batch's record field and run nothing. The
// relay, which saw an error, settles the batch from the record under a new
// fence token (epoch 2), and deletes the rows without pushing them again.
func TestStalledRedisRunsThePushOnce(t *testing.T) {
	t.Parallel()
	srv := testenv.StartRedis(t)
	h := newHarness(t)
	rdb := redis.NewClient(&redis.Options{Addr: fmt.Sprintf("127.0.0.1:%d", srv.Port), DisableIdentity: true,
		ReadTimeout: 300 * time.Millisecond, WriteTimeout: 300 * time.Millisecond})
	t.Cleanup(func() { _ = rdb.Close() })
	h.rdb = rdb
	jids := h.stageMany(relay.Job{Name: "first"})

	cfg := h.config()
	cfg.Redis = rdb
	r, err := relay.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	// The second push is stalled: the first loaded the script (a resent
	// EVALSHA of a script the server does not know would only be refused).
	var pushes atomic.Int32
	resumed := make(chan struct{})
	relay.SetBeforePush(r, func(context.Context) {
		if pushes.Add(1) == 2 {
			testenv.WarmPool(t, rdb, 4)
			srv.Signal(syscall.SIGSTOP)
			// The fault: frozen for longer than the client's read
			// timeouts of all four tries (4 x 300ms).
			time.AfterFunc(2*time.Second, func() {
				srv.Signal(syscall.SIGCONT)
				close(resumed)
			})
		}
	})
	h.run(r)
	h.waitStaged(0)
	jids = append(jids, h.stageMany(relay.Job{Name: "A"}, relay.Job{Name: "B"}, relay.Job{Name: "C"})...)
	<-resumed
	h.waitStaged(0)
	h.waitRecordEmpty()
	got := h.queueJIDs("default")
	slices.Sort(got)
	if want := slices.Sorted(slices.Values(jids)); !slices.Equal(got, want) {
		t.Fatalf("queue holds %v, want each of %v once", got, want)
	}
	fence, _ := h.handoffKeys()
	if epoch, err := rdb.HGet(context.Background(), fence, "epoch").Int(); err != nil || epoch != 2 {
		t.Fatalf("fence epoch = %d, %v; want 2: a push with no reply is settled under a new token", epoch, err)
	}
}

// With RedisWaitReplicas, a batch's rows are deleted only once a replica
// has its push. Here the replica is frozen: the push reaches the primary,
// WAIT times out, and the row stays staged through every retry (each of
// which finds the row delivered in the record and runs the script only to
// WAIT again). Once the replica runs again, the row is deleted, and the job
// was pushed once.
func TestWaitReplicasKeepsRowsUntilAReplicaHasThePush(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	primary := testenv.StartRedis(t)
	replica := testenv.StartRedis(t, "--replicaof", "127.0.0.1", fmt.Sprint(primary.Port))
	h := newHarness(t)
	rdb := redis.NewClient(&redis.Options{Addr: fmt.Sprintf("127.0.0.1:%d", primary.Port), DisableIdentity: true})
	t.Cleanup(func() { _ = rdb.Close() })
	h.rdb = rdb
	testenv.WaitFor(t, 15*time.Second, "the replica to be in sync", func() (bool, string) {
		n, err := rdb.Wait(ctx, 1, 100*time.Millisecond).Result()
		return err == nil && n == 1, fmt.Sprint(n, err)
	})
	cfg := h.config()
	cfg.Redis = rdb
	cfg.RedisWaitReplicas = 1
	cfg.RedisWaitTimeout = 100 * time.Millisecond
	cfg.MaxBackoff = 200 * time.Millisecond
	h.start(cfg)
	jids := h.stageMany(relay.Job{Name: "A"})
	h.waitStaged(0)

	replica.Signal(syscall.SIGSTOP)
	failed := h.logs.FilterMessage("batch failed, retrying").Len()
	jids = append(jids, h.stage(relay.Job{Name: "B"}))
	// Three failures: the first push, then retries that find B delivered.
	h.waitLog("batch failed, retrying", failed+3)
	if n := h.staged(); n != 1 {
		t.Fatalf("%d rows staged while no replica acknowledges, want B's row", n)
	}
	last := h.logs.FilterMessage("batch failed, retrying").All()
	if err := fmt.Sprint(last[len(last)-1].ContextMap()["error"]); !strings.Contains(err, "0 of 1 replicas acknowledged") {
		t.Fatalf("batch failed with %s, want the replica count", err)
	}
	replica.Signal(syscall.SIGCONT)
	h.waitStaged(0)
	got := h.queueJIDs("default")
	slices.Sort(got)
	if want := slices.Sorted(slices.Values(jids)); !slices.Equal(got, want) {
		t.Fatalf("queue holds %v, want each of %v once", got, want)
	}
}

// A fence taken by a relay of another PostgreSQL cluster (another
// system_identifier) whose database and schema names match: the relay
// refuses to run (ErrForeignFence) rather than read that deployment's
// record, and pushes nothing.
func TestForeignFenceIsRefused(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	h := newHarness(t)
	fence, _ := h.handoffKeys()
	if err := h.rdb.HSet(ctx, fence, "system", "1234567890", "epoch", 7, "token", "theirs").Err(); err != nil {
		t.Fatal(err)
	}
	h.stage(relay.Job{Name: "A"})
	r, err := relay.New(h.config())
	if err != nil {
		t.Fatal(err)
	}
	rctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	err = r.Run(rctx)
	if !errors.Is(err, relay.ErrForeignFence) || !strings.Contains(err.Error(), "1234567890") {
		t.Fatalf("Run = %v, want ErrForeignFence naming the other cluster", err)
	}
	if n := h.staged(); n != 1 {
		t.Fatalf("%d rows staged, want the job left staged", n)
	}
	if got := h.queueJIDs("default"); len(got) != 0 {
		t.Fatalf("pushed %v past a foreign fence", got)
	}
}
