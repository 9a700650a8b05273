package relay

import (
	"time"

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
// So a fleet whose schemas' commits come at hotEnter a second or more runs
// hot (counted as their notifications, or the jobs their drains find in
// short batches if those are more: a commit does not notify while another
// commit of its schema is notifying, sql/012_wake_one_notifier.sql, so
// notifications alone undercount the commits the more they overlap): it
// holds every schema it leads awake (no idle lock is held: no commit
// notifies) and polls them all in one statement every hotStep, waking the
// drains of those with rows staged, which drain and return without going
// idle. When its polls (and any notifications) find
// fewer than hotLeave schemas with rows a second, over hotLeaveAfter, it
// cools: every schema's drain runs once more and goes idle as a relay of
// one schema does (gate.sleep takes the idle lock and reads the
// transactions in progress), so a commit made while the fleet was hot is
// found by that drain or by the late-commit checks, as any commit that
// saw a relay awake. Going hot needs no such care: commits keep notifying
// until each schema's idle lock is released.
const (
	hotWindow     = 100 * time.Millisecond
	hotEnter      = 200 // commits a second: notifications, or jobs found
	hotLeave      = 100 // schemas found with rows a second
	hotLeaveAfter = time.Second

	// hotStep is hotStepPerSchema times the schemas led, within
	// [minHotStep, maxHotStep]: the poll is an index probe per schema,
	// about 5-10µs each, so that a fleet of 200 spends about as much of
	// PostgreSQL's time polling as a fleet of 20.
	minHotStep       = time.Millisecond
	hotStepPerSchema = 20 * time.Microsecond
	maxHotStep       = 10 * time.Millisecond
)

// fleetHeat is the session loop's view of whether the fleet runs hot.
type fleetHeat struct {
	ticker *time.Ticker
	poll   *time.Timer
	hot    bool
	since  time.Time // start of the window hits counts
	hits   int       // schemas found with rows, by polls and notifications
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
func (s *fleetSession) weigh(h *fleetHeat) {
	noted := int(s.f.noted.Swap(0))
	found := int(s.f.found.Swap(0))
	now := time.Now()
	if !h.hot {
		if float64(max(noted, found)) < s.f.hotEnter*hotWindow.Seconds() {
			return
		}
		h.hot, h.since, h.hits = true, now, 0
		s.f.hot.Store(true)
		s.wakeLed() // each drain releases its schema's idle lock
		h.pollAgain(len(s.led()))
		s.f.r.log.Debug("fleet runs hot: polling every schema led", zap.Int("notifications", noted), zap.Int("jobs", found), zap.Duration("window", hotWindow))
		return
	}
	h.hits += noted
	d := now.Sub(h.since)
	if d < hotLeaveAfter {
		return
	}
	if float64(h.hits)/d.Seconds() >= s.f.hotLeave {
		h.since, h.hits = now, 0
		return
	}
	h.hot = false
	h.poll.Stop()
	s.cool()
	s.f.r.log.Debug("fleet cools: each schema goes idle between its drains", zap.Int("found", h.hits), zap.Duration("window", d))
}

// cool lets each schema's drain go idle again: it wakes every drain, which
// drains once more and goes idle (gate.sleep).
func (s *fleetSession) cool() {
	if s.f.hot.Swap(false) {
		s.wakeLed()
	}
}

func (s *fleetSession) wakeLed() {
	for _, t := range s.led() {
		trySendWakeup(t.wake)
	}
}
