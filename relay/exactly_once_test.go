package relay_test

import (
	"context"
	"fmt"
	"slices"
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
			go func() {
				defer close(resumed)
				// The fault: frozen for longer than the client's read
				// timeouts of all four tries (4 x 300ms).
				time.Sleep(2 * time.Second)
				srv.Signal(syscall.SIGCONT)
			}()
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
