package relay

import "time"

// The drain's timing: how long it lingers awake after the last claim that
// found jobs, and how far apart it paces claims while jobs flow (drain.go).

// While awake, an empty claim is followed by another one a quarter of the
// time since the last claim that found jobs later (at least minLingerStep,
// at most maxLingerStep), for up to lingerFor since that claim, or
// lingerFast while jobs flow at fastFlow or more; only then does the relay
// go idle. Under a fast flow of commits it stays awake, and they need not
// NOTIFY; a lull longer than that costs the next commit a notification,
// and the relay a wake-up.
//
// Below fastFlow, commits rarely overlap, so a notification per commit
// costs the app little, and the relay goes idle as soon as a claim has
// found nothing for lingerFor. Lingering longer there makes things worse:
// at 1,000 jobs/s the relay would never go idle, and its claims every few
// hundred microseconds took CPU from the app, PostgreSQL and Redis on a
// 2-core machine; a job then took about 1.1ms (p50) from its COMMIT to
// Redis, against 0.6-0.7ms when each commit notifies an idle relay
// (stagedrain bench, README "Performance").
const (
	lingerFor     = 500 * time.Microsecond
	lingerFast    = 20 * time.Millisecond
	minLingerStep = 100 * time.Microsecond
	maxLingerStep = time.Millisecond
)

// fastFlow is the rate of jobs (per second) from which the relay lingers
// lingerFast.
const fastFlow = 2000

func lingerStepAfter(quiet time.Duration) time.Duration {
	return min(max(quiet/4, minLingerStep), maxLingerStep)
}

// flowRate measures the rate at which a drain finds jobs, over windows of
// at least rateWindow.
type flowRate struct {
	start  time.Time
	jobs   int
	perSec float64 // jobs per second over the last full window
}

const rateWindow = 20 * time.Millisecond

func (f *flowRate) found(n int, now time.Time) {
	if f.start.IsZero() {
		f.start = now
	}
	f.jobs += n
	if d := now.Sub(f.start); d >= rateWindow {
		f.perSec = float64(f.jobs) / d.Seconds()
		f.start, f.jobs = now, 0
	}
}

func (f *flowRate) linger() time.Duration {
	if f.perSec >= fastFlow {
		return lingerFast
	}
	return lingerFor
}

// After a short batch of n jobs, the next claim starts no sooner than
// n x pacePerJob (at most maxPace()) after that batch's claim. Below about
// 1/pacePerJob = 4,000 jobs/s a batch holds a job or two and the pace is
// shorter than a batch takes anyway; above it, batches grow until the
// relay claims every maxPace(), which bounds the added latency.
//
// maxPace is minPaceCap up to paceFlow jobs/s, and grows in proportion to
// the flow above it, up to maxPaceCap (at twice paceFlow): each batch costs
// the app's commits a little, whatever its size, and a busier app gains
// more from fewer batches. pgbench beside the relay, 16 writers at about
// 15,000 jobs/s, 4 rounds: 97% of a polling relay's TPS with a 5ms cap,
// 102% with 10ms, 102% with 20ms; at 5,000 jobs/s a 10ms cap would put
// p99 at about 11.5ms, against 6.5-8ms with 5ms (README, "Performance").
const (
	pacePerJob = 250 * time.Microsecond
	minPaceCap = 5 * time.Millisecond
	maxPaceCap = 10 * time.Millisecond
	paceFlow   = 5000
)

// From fastFlow jobs/s on, claims are at least flowPace apart: at 3,600
// jobs/s a batch otherwise held a job or two, and each batch's round trips
// (claim, push, delete and commit) cost the relay and PostgreSQL more than
// the jobs did: the app kept 86% of its write TPS beside the relay against
// 97% beside a polling one (stagedrain bench --scenarios app-cost, issue
// 23). It adds at most flowPace to a job's latency where the target is
// p99 <= 10ms (5,000 jobs/s); below fastFlow, where a job should take
// about a millisecond, it does not apply.
const flowPace = 2 * time.Millisecond

func (f *flowRate) minPace() time.Duration {
	if f.perSec >= fastFlow {
		return flowPace
	}
	return 0
}

func (f *flowRate) maxPace() time.Duration {
	c := time.Duration(float64(minPaceCap) * f.perSec / paceFlow)
	return min(max(c, minPaceCap), maxPaceCap)
}
