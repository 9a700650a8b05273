package relay_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stagedrain/stagedrain/relay"
	"github.com/stagedrain/stagedrain/relay/internal/testenv"
)

// A fleet whose schemas' commits notify often runs hot: it holds every
// schema it leads awake, so that no commit notifies, and finds their rows
// by polling them all at once; when the commits stop it cools, and each
// schema goes idle again and is notified. Checked by which commits notify
// (a marker notification: notifications arrive in commit order) and who
// holds the idle locks, not by timing. The fallback poll is an hour away,
// so only the hot poll can deliver a commit that does not notify.
func TestFleetHotHoldsEverySchemaAwake(t *testing.T) {
	t.Parallel()
	fh := newFleetHarness(t, 3)
	cfg := fh.fleetConfig()
	cfg.PollInterval = time.Hour
	quiet, busy := fh.schemas[0], fh.schemas[1:]
	r := fh.start(cfg)
	testenv.WaitFor(t, 10*time.Second, "the relay leads every schema", func() (bool, string) {
		got := leads(r)
		return len(got) == len(fh.schemas), fmt.Sprintf("leads %q", got)
	})
	for _, s := range fh.schemas {
		waitIdleHeldBy(t, fh.conn, s, fh.leaderPID(s), "its leader (idle)")
	}

	// Commits in the busy schemas, one job each, from four sessions, until
	// told to stop: each notifies while its schema is idle.
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var mu sync.Mutex
	var staged []string
	for w := range 4 {
		conn := testenv.ConnTo(t, testenv.DatabaseURL())
		wg.Go(func() {
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				schema := busy[(w+i)%len(busy)]
				var jid string
				err := conn.QueryRow(context.Background(), fmt.Sprintf(
					`INSERT INTO %q.staged_jobs (job_name, job_args, queue) VALUES ('W', '[]', 'busy') RETURNING jid`, schema)).Scan(&jid)
				if err != nil {
					t.Errorf("stage in %s: %v", schema, err)
					return
				}
				mu.Lock()
				staged = append(staged, jid)
				mu.Unlock()
			}
		})
	}
	stopped := false
	stopCommits := func() {
		if !stopped {
			stopped = true
			close(stop)
			wg.Wait()
		}
	}
	defer stopCommits()
	testenv.WaitFor(t, 30*time.Second, "the fleet runs hot", func() (bool, string) {
		return relay.FleetHot(r), "not hot"
	})
	// Hot: every schema's drain gives its idle lock back, the quiet one's
	// too, though nothing was staged in it.
	for _, s := range fh.schemas {
		testenv.WaitFor(t, 10*time.Second, s+"'s idle lock held by nobody while the fleet runs hot", func() (bool, string) {
			if !relay.FleetHot(r) {
				t.Fatal("the fleet cooled while its schemas took commits")
			}
			got := idleHolders(t, fh.conn, s)
			return len(got) == 0, fmt.Sprintf("held by %v", got)
		})
	}
	listener := listen(t, testenv.DatabaseURL(), quiet)
	jid := fh.stageIn(quiet, "default")
	checkDidNotNotify(t, listener, quiet, "a commit while the fleet runs hot")
	fh.waitJIDs("default", []string{jid})

	// Cooled: each schema goes idle again, and a commit notifies.
	stopCommits()
	mu.Lock()
	fh.waitJIDs("busy", staged)
	mu.Unlock()
	testenv.WaitFor(t, 30*time.Second, "the fleet cools once the commits stop", func() (bool, string) {
		return !relay.FleetHot(r), "still hot"
	})
	for _, s := range fh.schemas {
		waitIdleHeldBy(t, fh.conn, s, fh.leaderPID(s), "its leader (idle again)")
	}
	fh.checkNotifies(quiet, []string{jid})
}
