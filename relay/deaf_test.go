package relay_test

import (
	"context"
	"fmt"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stagedrain/stagedrain/relay"
	"github.com/stagedrain/stagedrain/relay/internal/testenv"
)

// Commits notify only while a relay is idle and listening. A relay whose
// listener has lost its session gives its idle lock back until the
// listener LISTENs again (a commit would otherwise notify nobody, and pay
// PostgreSQL's notify lock for it), and takes it again after that LISTEN's
// drain. The listener's reconnect is held at its connect hook, after the
// connection and before the LISTEN.
func TestDeafRelayHoldsNoIdleLock(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	cfg := h.config()
	cfg.PollInterval = time.Hour // only the LISTEN's drain may deliver
	r, err := relay.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	var connects atomic.Int32
	var listener atomic.Uint32
	release := make(chan struct{})
	t.Cleanup(func() {
		select {
		case <-release:
		default:
			close(release)
		}
	})
	relay.SetOnListenerConnected(r, func(pid uint32) {
		listener.Store(pid)
		if connects.Add(1) == 2 {
			<-release // the reconnect, held before its LISTEN
		}
	})
	h.run(r)
	testenv.WaitFor(t, 10*time.Second, "the relay leads", func() (bool, string) {
		return r.Status().Role == relay.RoleLeader, fmt.Sprint(r.Status().Role)
	})
	pid := leaderPIDOf(t, h.conn, h.schema)
	waitIdleHeldBy(t, h.conn, h.schema, pid, "the leader (idle and listening)")

	// The listener's session ends; its reconnect waits at the hook.
	if _, err := h.conn.Exec(context.Background(), `SELECT pg_terminate_backend($1)`, int64(listener.Load())); err != nil {
		t.Fatal(err)
	}
	testenv.WaitFor(t, 10*time.Second, "the listener reconnecting", func() (bool, string) {
		return connects.Load() >= 2, fmt.Sprintf("%d connects", connects.Load())
	})
	testenv.WaitFor(t, 10*time.Second, "the idle lock given back while nobody listens", func() (bool, string) {
		got := idleHolders(t, h.conn, h.schema)
		return len(got) == 0, fmt.Sprintf("held by %v", got)
	})
	// A commit meanwhile notifies nobody, and waits for the LISTEN's drain.
	listen := listen(t, testenv.DatabaseURL(), h.schema)
	jid := stageOn(t, h, h.conn, "W")
	checkDidNotNotify(t, listen, h.schema, "a commit while the relay's listener was down")
	if got := h.queueJIDs("default"); slices.Contains(got, jid) {
		t.Fatalf("job %s delivered before the listener LISTENed, with the poll an hour away", jid)
	}

	close(release)
	testenv.WaitFor(t, 10*time.Second, "the job delivered after the LISTEN", func() (bool, string) {
		got := h.queueJIDs("default")
		return slices.Contains(got, jid), fmt.Sprintf("queue holds %v", got)
	})
	waitIdleHeldBy(t, h.conn, h.schema, pid, "the leader (listening again, idle)")
}
