package relay

import (
	"cmp"
	"context"
	"time"

	"github.com/jackc/pgx/v5"

	"go.uber.org/zap"
)

// A fleet running hot. Each schema of a fleet sees its share of the app's
// commits, so its drain goes idle between two of them and each commit
// notifies; and notifying commits are serialized by PostgreSQL's notify
// lock through their WAL flush. Beside a fleet of 20 schemas the app kept
// 10-29% of its write throughput, and of 200, 15-17% (issue 23). A relay
// of one schema stays awake while commits come often (its drain lingers,
// pace.go); a fleet cannot linger on every schema at once without a claim
// per schema each step.
//
// So a fleet whose schemas' commits come at hotEnter a second or more, and
// queue for the notify lock (see below), runs hot (counted as their
// notifications, or the jobs their drains find in short batches if those
// are more: a commit does not notify while another
// commit of its schema is notifying, sql/012_wake_one_notifier.sql, so
// notifications alone undercount the commits the more they overlap): it
// holds every schema it leads awake (no idle lock is held: no commit
// notifies) and polls them all in one statement every hotStep, waking the
// drains of those with rows staged, which drain and return without going
// idle. When its polls (and any notifications) find
// fewer than hotLeave schemas with rows a second, over hotLeaveAfter, it
// cools: every schema goes idle as a relay of one schema does (gate.sleep
// takes the idle lock and reads the transactions in progress), all of them
// in one round trip (coolDown), and one poll follows, so a commit made
// while the fleet was hot is found by that poll or by the late-commit
// checks, as any commit that saw a relay awake. Going hot needs no such
// care: commits keep notifying until the idle locks are released
// (holdAwake, one statement too).
//
// Entering is judged over the last hotEnterWindows windows (500ms), or over
// the last window alone at hotBurst times the rate: a fleet of 20 or 200
// schemas at 100 commits a second saw 20 commits in some 100ms window
// every few seconds (Poisson arrivals), ran hot, found about 100 schemas a
// second, cooled a second later, and so on; each turn woke every schema's
// drain (before coolDown and holdAwake), and a job at 100 jobs/s took
// 117-180ms at p99, against 7ms in runs that stayed cool (stagedrain bench
// --scenarios fleet-latency). A sustained rate enters within 500ms, 1.25
// times it within 100ms; at 100 a second, 25 in a window comes about once
// in 10,000 windows. Going hot and cooling each take one round trip on the
// lock connection (holdAwake, coolDown).
//
// A rate alone is not what the app pays, though: notifying commits cost
// the app only when they wait for each other. Running hot costs latency
// instead: a hot fleet finds a commit by its next poll and drains it in a
// shared drain, 2ms at p50 over 20 schemas at 1,000 jobs/s on the
// machine of the README's figures, where a cool fleet, each commit
// notifying, took 0.4ms; and a cool fleet there let the app keep 80-85%
// of its write TPS over 20 schemas, 56-63% over 200, at full speed, where
// a hot one let it keep 95-98% (stagedrain bench --scenarios app-cost and
// fleet-latency, with the fleet held cool and hot). How fast commits can
// notify one after the other is the WAL flush's time: a disk that flushes
// in 3ms lets the app commit some 300 notifying commits a second, one that
// flushes in 0.1ms ten times that. So between hotWaitFrom and hotAlways
// commits a second the fleet runs hot only when the app's commits queue
// for PostgreSQL's notify lock: every window it counts the sessions that
// wait for a lock on an object in pg_stat_activity (the notify lock is
// one; the app's own DDL waits on such locks too, rarely), and runs hot
// when hotContended of the last hotWaitWindows counts found one or more,
// or the last 3 found hotWaitHeavy together.
// On that machine, a cool fleet at 1,000 jobs/s had such a waiter in
// 1-16% of samples (0.01-0.3 on average; a rule of 3 waiters over 5
// samples sent it hot at times; so did 4 of 5 windows with a waiter, or 4
// waiting at once, in the first second of such a load, as its writers
// started, when up to a third of the samples found one, 0.56 on average),
// at full speed in 23-99% (0.3-6.5 on average; over 200 schemas 94-99%,
// 4-6.5: 8 over 3 windows shows that in 300ms, where 7 of 10 windows
// alone took a second, and the app kept 88% of its TPS). A disk that
// cannot keep up with the notifying commits has them queue always.
// hotAlways is under the full speed of the app-cost scenario's writers
// over 200 schemas there (1,850-2,000 commits a second).
// From hotAlways commits a second, sustained over hotEnterWindows, it runs
// hot whatever it counts; a burst of hotBurst times hotAlways in one window
// alone runs hot only on waits, as a lower rate does: an app that stalls
// and catches up commits at twice its rate for as long as it stalled (the
// bench's writers, 1,700-2,400 commits a second for 100ms, at 1,000 jobs/s
// over 200 schemas), its commits notifying one after the other without
// queueing, and a fleet that ran hot on that for hotProbe (2s) found each
// of its jobs by a poll, 6ms at p50 against 0.5ms cool. A role
// that cannot see other roles' wait events (neither pg_read_all_stats nor
// a superuser) counts nothing, so its fleet runs hot from hotEnter, on the
// rate alone, as before.
//
// Waits are counted from hotWaitFrom commits a second, not from hotEnter:
// a disk that flushes slowly caps the notifying commits, each holding the
// notify lock through its flush, under hotEnter a second, and a fleet that
// counted waits only from there never ran hot while the app's commits
// queued (beside a fleet of 200 on a server with commit_delay=8ms, the app
// kept 13% of its TPS; counted from hotWaitFrom, 95%; and the bench's
// fleet of 200 read anywhere from 21% to 85% from one sitting to another).
// Under hotWaitFrom a second the fleet does not count: the commits are too
// few for the app to feel the lock.
//
// A hot fleet tries cool again hotProbe after it went hot (doubled
// each time it goes hot again within hotProbeFail of trying, up to
// hotProbeMax; back to hotProbe after hotProbeReset cool) while its rate
// is under hotAlways: the app may have slowed, and a hot fleet sees no
// notifications to count waits by. A try that finds waits again costs the
// app its notifying commits until the fleet runs hot again; so within
// hotProbeFail of the try, hotProbeWaits waiting over 2 windows are
// enough (the app's commits queued a few seconds before; the rule of a
// fleet that is cool for other reasons took 0.3-1.8s to see that again,
// in the bench's app-cost fleets, where this takes 0.1-0.45s).
const (
	hotWindow       = 100 * time.Millisecond
	hotEnterWindows = 5
	hotBurst        = 1.25
	hotEnter        = 200  // commits a second: notifications, or jobs found
	hotWaitFrom     = 20   // commits a second from which waits are counted
	hotAlways       = 1500 // commits a second from which it runs hot without waits
	hotWaitWindows  = 10   // the windows whose waiters are weighed (1s)
	hotContended    = 7    // windows of hotWaitWindows that ended with a waiter
	hotWaitHeavy    = 8    // waiters over the last 3 windows' ends that make it run hot
	hotLeave        = 100  // schemas found with rows a second
	hotLeaveAfter   = time.Second

	hotProbe      = 2 * time.Second
	hotProbeFail  = 2 * time.Second
	hotProbeMax   = 80 * time.Second
	hotProbeReset = time.Minute
	// hotProbeWaits is the waiters over the last 2 windows that make a
	// fleet trying cool run hot again, within hotProbeFail of the try:
	// about hotWaitHeavy's rate, seen a window sooner.
	hotProbeWaits = 6
	// hotDropWindows is how many windows in a row, each under hotDrop
	// times hotAlways's rate, make a fleet whose try is due try cool at
	// once, not at the end of its second (see fleetHeat.dropped).
	hotDropWindows = 3
	hotDrop        = 0.5

	// hotStep is hotStepPerSchema times the schemas led, within
	// [minHotStep, maxHotStep]: the poll is an index probe per schema,
	// about 5-10µs each, so that a fleet of 200 spends about as much of
	// PostgreSQL's time polling as a fleet of 20.
	minHotStep       = time.Millisecond
	hotStepPerSchema = 20 * time.Microsecond
	maxHotStep       = 10 * time.Millisecond
)

// notifyWaitersSQL counts the sessions, of the whole cluster, that wait for
// a lock on an object: among them the commits that wait for PostgreSQL's
// notify lock (async.c's PreCommit_Notify, a lock on database 0's object).
const notifyWaitersSQL = `SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND wait_event = 'object'`

// seesWaitsSQL reports whether the role may see other roles' wait events
// (pg_read_all_stats, a member of pg_monitor; a superuser is a member of
// every role).
const seesWaitsSQL = `SELECT pg_has_role('pg_read_all_stats', 'USAGE')`

// fleetHeat is the session loop's view of whether the fleet runs hot.
type fleetHeat struct {
	ticker *time.Ticker
	poll   *time.Timer
	hot    bool
	since  time.Time // start of the window hits counts
	hits   int       // schemas found with rows, by polls and notifications
	jobs   int       // jobs found in short batches, since
	// pollFailed is set when a hot poll failed since the window began
	// (see cools); winFailed, since the last hotWindow began.
	pollFailed, winFailed bool
	// The last hotDropWindows hot windows' finds (see dropped): each the
	// larger of the schemas and the jobs found, -1 for a window whose
	// poll failed; drop[dnext] the oldest, dseen how many were counted
	// since the fleet went hot; hitsAt and jobsAt are hits and jobs at
	// the last window's end.
	drop           [hotDropWindows]int
	dnext, dseen   int
	hitsAt, jobsAt int
	// recent are the commits counted in the last hotEnterWindows windows
	// while cool, recent[next] the oldest; waits the sessions counted
	// waiting for a lock on an object at the end of each of the last
	// hotWaitWindows (0 while the rate is under hotEnter: not counted).
	recent [hotEnterWindows]int
	next   int
	waits  [hotWaitWindows]int
	wnext  int

	// Trying cool while hot (see hotProbe): when the next try is due; the
	// interval; and when the fleet last went cool, and whether on a try.
	probeAt    time.Time
	probeEvery time.Duration
	probeFirst time.Duration // hotProbe, unless a test changed it
	cooledAt   time.Time
	probing    bool
}

// count adds a cool window's commits.
func (h *fleetHeat) count(n int) {
	h.recent[h.next] = n
	h.next = (h.next + 1) % hotEnterWindows
}

// over reports whether the commits counted reach perSec (see
// hotEnterWindows): over the last hotEnterWindows windows, or hotBurst
// times it in the last one.
func (h *fleetHeat) over(perSec float64) bool {
	last := h.recent[(h.next+hotEnterWindows-1)%hotEnterWindows]
	return h.sustained(perSec) || float64(last) >= hotBurst*perSec*hotWindow.Seconds()
}

// sustained reports whether the commits counted over the last
// hotEnterWindows windows reach perSec.
func (h *fleetHeat) sustained(perSec float64) bool {
	sum := 0
	for _, c := range h.recent {
		sum += c
	}
	return float64(sum) >= perSec*float64(hotEnterWindows)*hotWindow.Seconds()
}

// waited records the sessions counted waiting for a lock on an object at
// the end of a window, and reports whether hotContended of the last
// hotWaitWindows counts found one or more, or the last 3 found
// hotWaitHeavy together.
func (h *fleetHeat) waited(n int) bool {
	h.waits[h.wnext] = n
	h.wnext = (h.wnext + 1) % hotWaitWindows
	if h.lastWaits(3) >= hotWaitHeavy {
		return true
	}
	windows := 0
	for _, w := range h.waits {
		if w > 0 {
			windows++
		}
	}
	return windows >= hotContended
}

// tryingSince reports whether the fleet cooled on a try (see hotProbe) less
// than hotProbeFail ago.
func (h *fleetHeat) tryingSince(now time.Time) bool {
	return h.probing && now.Sub(h.cooledAt) < hotProbeFail
}

// lastWaits is the sessions counted waiting at the ends of the last n
// windows (waited), together.
func (h *fleetHeat) lastWaits(n int) int {
	sum := 0
	for i := 1; i <= n; i++ {
		sum += h.waits[(h.wnext+hotWaitWindows-i)%hotWaitWindows]
	}
	return sum
}

// start returns the channel that ticks every hotWindow; nil in poll-only
// mode, where no commit notifies and the fleet never runs hot.
func (h *fleetHeat) start(pollOnly bool) <-chan time.Time {
	if pollOnly {
		return nil
	}
	h.ticker = time.NewTicker(hotWindow)
	h.poll = time.NewTimer(time.Hour)
	h.poll.Stop()
	return h.ticker.C
}

func (h *fleetHeat) stop() {
	if h.ticker != nil {
		h.ticker.Stop()
		h.poll.Stop()
	}
}

// pollC is the hot poll's channel while the fleet runs hot, nil otherwise.
func (h *fleetHeat) pollC() <-chan time.Time {
	if !h.hot {
		return nil
	}
	return h.poll.C
}

// pollAgain arms the next hot poll for a fleet leading n schemas.
func (h *fleetHeat) pollAgain(n int) {
	h.poll.Reset(hotStep(n))
}

func hotStep(n int) time.Duration {
	return min(max(time.Duration(n)*hotStepPerSchema, minHotStep), maxHotStep)
}

// weigh, every hotWindow, makes the fleet run hot or cool (see fleetHeat).
func (s *fleetSession) weigh(ctx context.Context, h *fleetHeat) {
	noted := int(s.f.noted.Swap(0))
	found := int(s.f.found.Swap(0))
	now := time.Now()
	if !h.hot {
		var waiters func() (int, error) // nil: the rate alone decides
		if s.seesWaits {
			waiters = func() (int, error) { return s.notifyWaiters(ctx) }
		}
		hot, waits := h.heats(now, max(noted, found), s.f.hotEnter, s.f.hotWaitFrom, s.f.hotAlways, waiters)
		if !hot {
			return
		}
		reason := "rate"
		if waits >= 0 {
			reason = "waits"
		}
		s.f.hotEntries.WithLabelValues(reason).Inc()
		s.f.hotGauge.Set(1)
		s.f.hot.Store(true)
		s.holdAwake(ctx)
		h.pollAgain(len(s.led()))
		s.f.r.log.Debug("fleet runs hot: polling every schema led", zap.Int("notifications", noted), zap.Int("jobs", found),
			zap.Int("waiting", waits), zap.Duration("window", hotWindow))
		return
	}
	cool, trying := h.cools(now, noted, found, s.f.hotLeave, s.f.hotAlways)
	if !cool {
		return
	}
	h.poll.Stop()
	s.coolDown(ctx)
	s.f.hotGauge.Set(0)
	s.f.r.log.Debug("fleet cools: each schema goes idle between its drains", zap.Bool("trying", trying))
}

// heats counts a cool window's n commits and reports whether the fleet
// runs hot from now: at always commits a second, sustained (a burst of
// always in one window runs hot on waits, as the rates under it do); from
// waitFrom, when the
// sessions waiters counts say the commits queue (waited); and, when waiters
// is nil (the role sees no waits), from enter on the rate alone. waits is
// the count (-1 when not asked).
func (h *fleetHeat) heats(now time.Time, n int, enter, waitFrom, always float64, waiters func() (int, error)) (hot bool, waits int) {
	if h.probeEvery > 0 && now.Sub(h.cooledAt) >= hotProbeReset {
		h.probeEvery = 0
	}
	h.count(n)
	waits = -1
	switch {
	case h.sustained(always):
	case waiters == nil:
		if !h.over(enter) {
			return false, waits
		}
	case !h.over(waitFrom):
		h.waited(0)
		return false, waits
	default:
		var err error
		if waits, err = waiters(); err != nil {
			h.waited(0)
			return false, waits
		}
		contended := h.waited(waits)
		if !contended && !(h.tryingSince(now) && h.lastWaits(2) >= hotProbeWaits) {
			return false, waits
		}
	}
	switch {
	case h.probeEvery == 0:
		h.probeEvery = cmp.Or(h.probeFirst, hotProbe)
	case h.tryingSince(now):
		h.probeEvery = min(2*h.probeEvery, hotProbeMax)
	}
	h.hot, h.pollFailed, h.winFailed, h.dseen = true, false, false, 0
	h.newSecond(now)
	h.probeAt, h.probing = now.Add(h.probeEvery), false
	h.recent, h.next, h.waits, h.wnext = [hotEnterWindows]int{}, 0, [hotWaitWindows]int{}, 0
	return true, waits
}

// polled counts a hot poll's schemas found, or its failure.
func (h *fleetHeat) polled(found int, err error) {
	h.hits += found
	if err != nil {
		h.pollFailed, h.winFailed = true, true
	}
}

// newSecond starts the second whose hits and jobs cools weighs.
func (h *fleetHeat) newSecond(now time.Time) {
	h.since, h.hits, h.jobs, h.hitsAt, h.jobsAt = now, 0, 0, 0, 0
}

// cools counts a hot window's notifications and jobs found, and reports
// whether the fleet cools now: once a second, when its polls and
// notifications found fewer than leave schemas a second, or, trying, when
// a try is due (hotProbe) and it found fewer than always jobs a second;
// and, trying, at the end of any window when a try is due and the app's
// rate has dropped (dropped).
func (h *fleetHeat) cools(now time.Time, noted, found int, leave, always float64) (cool, trying bool) {
	h.hits += noted
	h.jobs += found
	n := max(h.hits-h.hitsAt, h.jobs-h.jobsAt)
	if h.winFailed {
		n = -1
	}
	h.drop[h.dnext] = n
	h.dnext = (h.dnext + 1) % hotDropWindows
	h.dseen++
	h.hitsAt, h.jobsAt, h.winFailed = h.hits, h.jobs, false
	if !now.Before(h.probeAt) && h.dropped(always) {
		h.hot, h.probing, h.cooledAt = false, true, now
		return true, true
	}
	d := now.Sub(h.since)
	if d < hotLeaveAfter {
		return false, false
	}
	if h.pollFailed {
		// A hot poll that failed found nothing, which does not say the
		// app went quiet: most often it timed out beside a saturated
		// server (the app at full speed over 200 schemas), and cooling
		// then sent the app's commits back to the notify lock just when
		// they queue the most. Seen in the bench's app-cost fleet of 200
		// (relay log at debug): hot polls timed out every 450ms, the
		// fleet cooled as quiet 1.8s after going hot and stayed cool for
		// the rest of the 8s run, and the app kept 66% of its TPS in that
		// run against 92% in the next. Such a window is weighed again, as
		// a busy one is.
		h.pollFailed = false
		h.newSecond(now)
		return false, false
	}
	quiet := float64(h.hits)/d.Seconds() < leave
	trying = !quiet && !now.Before(h.probeAt) && float64(max(h.hits, h.jobs))/d.Seconds() < always
	if !quiet && !trying {
		h.newSecond(now)
		return false, false
	}
	h.hot, h.probing, h.cooledAt = false, trying, now
	return true, trying
}

// dropped reports whether each of the last hotDropWindows windows found
// fewer than hotDrop times always's rate, and no poll of theirs failed:
// the app's rate has dropped. A fleet still hot from a full-speed load
// whose try is due then tries cool at once. Weighed over its second
// alone, it tried 1-2s after the drop, and each job of those seconds was
// found by a hot poll: after the bench's app-cost rounds over 200 schemas
// (relay log at debug), the fleet stayed hot for the first 1.3s of the
// 100 jobs/s latency run, whose jobs took 3-7ms then against 0.6ms at p50
// once cool. Half of always keeps a full-speed load's short dips (a
// checkpoint's flush) from trying; a try, when due, costs what it does at
// the end of a second.
func (h *fleetHeat) dropped(always float64) bool {
	if h.dseen < hotDropWindows {
		return false
	}
	for _, n := range h.drop {
		if n < 0 || float64(n) >= hotDrop*always*hotWindow.Seconds() {
			return false
		}
	}
	return true
}

// notifyWaiters counts the sessions waiting for a lock on an object
// (notifyWaitersSQL), on the lock connection.
func (s *fleetSession) notifyWaiters(ctx context.Context) (n int, err error) {
	err = s.exec(ctx, func(ctx context.Context, conn *pgx.Conn) error {
		return conn.QueryRow(ctx, notifyWaitersSQL).Scan(&n)
	})
	return n, err
}

// holdAwake releases the idle locks of every schema led that holds them,
// in one statement on the lock connection, as each schema's drain would
// (gate.wake) if woken: a fleet going hot woke all of them, and over 200
// schemas those 200 round trips on the one lock connection, and a claim
// each on the drain pool, took the time the hot poll needed, while every
// commit of a schema not yet woken went on notifying. No drain need run:
// the hot poll finds what they would. If the statement fails, each drain
// is woken and releases its own.
func (s *fleetSession) holdAwake(ctx context.Context) {
	s.mu.Lock()
	defer s.mu.Unlock()
	// A schema backpressure holds back stays idle, notified, as its drain
	// leaves it (gate.hot); its drain sets heldBack before it takes the
	// idle lock.
	gates, keys := gatesOf(s.led(), func(t *tenant, g *gate) bool {
		return !g.awake.Load() && !t.r.heldBack.Load()
	})
	if len(gates) == 0 {
		return
	}
	err := withTimeout(ctx, gates[0].timeout, func(ctx context.Context) error {
		_, err := s.conn.Exec(ctx, gateUnlockSQL, keys.args()...)
		return err
	})
	if err != nil {
		s.f.r.log.Debug("fleet runs hot: releasing the idle locks failed; each drain releases its own", zap.Error(err))
		for _, t := range s.led() {
			trySendWakeup(t.wake)
		}
		return
	}
	for _, g := range gates {
		g.awake.Store(true)
	}
}

// gatesOf returns the gates of the leads in progress of led that want
// picks, and their idle locks' keys. The caller holds the lock
// connection's mutex, under which a lead sets and clears its gate.
func gatesOf(led []*tenant, want func(t *tenant, g *gate) bool) (gates []*gate, keys gateKeys) {
	for _, t := range led {
		if g := t.r.gate.Load(); g != nil && want(t, g) {
			gates = append(gates, g)
			keys.add(g.idleKeys)
		}
	}
	return gates, keys
}

// coolDown lets every schema led go idle again, as its drain would
// (gate.sleep), for all of them at once: in one round trip on the lock
// connection it takes every idle lock and reads the transactions in
// progress; then one poll wakes the drains of the schemas that hold rows,
// and the session checks those transactions (s.late) and polls again when
// one has ended. So a commit that saw its schema awake is drained: it had
// committed before the locks were taken (the poll after them finds its
// row), or it was in progress then (its end is seen). Waking every drain
// instead, to drain once and go idle, took over 200 schemas 200 claims on
// the drain pool and 200 round trips on the lock connection, one after
// the other: 140-210ms during which jobs waited (p99 at 100 jobs/s). If
// the locks cannot be taken, every drain is woken to go idle on its own.
func (s *fleetSession) coolDown(ctx context.Context) {
	if !s.f.hot.Swap(false) {
		return
	}
	led := s.led()
	if !s.sleepAll(ctx, led) {
		s.wakeLed()
		return
	}
	s.poll(ctx, led, false)
}

// sleepAll takes the idle locks of each schema of led that is awake and
// may go idle, reads the transactions in progress into s.late, and marks
// their gates idle; false if that failed (the locks it took are given
// back).
func (s *fleetSession) sleepAll(ctx context.Context, led []*tenant) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	// The fleet is no longer hot: heldAwake is the listener's state.
	gates, keys := gatesOf(led, func(_ *tenant, g *gate) bool {
		return g.awake.Load() && !g.pinned && !g.heldAwake()
	})
	if len(gates) == 0 {
		return true
	}
	b := &pgx.Batch{}
	b.Queue(gateLockSQL, keys.args()...)
	var xids []int64
	b.Queue(inProgressSQL).QueryRow(func(row pgx.Row) error { return row.Scan(&xids) })
	err := withTimeout(ctx, gates[0].timeout, func(ctx context.Context) error {
		return s.conn.SendBatch(ctx, b).Close()
	})
	if err != nil {
		s.f.r.log.Debug("fleet cools: taking the idle locks failed; each drain goes idle on its own", zap.Error(err))
		_ = withTimeout(ctx, gates[0].timeout, func(ctx context.Context) error {
			_, err := s.conn.Exec(ctx, gateUnlockSQL, keys.args()...)
			return err
		})
		return false
	}
	for _, g := range gates {
		g.awake.Store(false)
	}
	s.late.add(xids, time.Now())
	return true
}

// checkLate asks which of s.late are still in progress, and polls every
// schema led when one has ended (see coolDown).
func (s *fleetSession) checkLate(ctx context.Context) {
	var left []int64
	err := s.exec(ctx, func(ctx context.Context, conn *pgx.Conn) error {
		return conn.QueryRow(ctx, stillInProgressSQL, s.late.ids()).Scan(&left)
	})
	if err != nil {
		// The lock connection's watch reports a broken session; until
		// then, poll as if one had ended.
		s.late.stop()
		s.late.xids = nil
		s.poll(ctx, s.led(), false)
		return
	}
	if s.late.checked(left, time.Now()) {
		s.poll(ctx, s.led(), false)
	}
}

// cool lets each schema's drain go idle again: it wakes every drain, which
// drains once more and goes idle (gate.sleep). The session's end uses it.
func (s *fleetSession) cool() {
	s.f.hotGauge.Set(0)
	if s.f.hot.Swap(false) {
		s.wakeLed()
	}
}

func (s *fleetSession) wakeLed() {
	for _, t := range s.led() {
		trySendWakeup(t.wake)
	}
}
