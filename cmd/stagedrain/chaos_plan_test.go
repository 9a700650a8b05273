package main

import (
	"cmp"
	"flag"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"
)

// TestChaos's plan: its -chaos.* flags, the size of a run (chaosPlan), what
// the producers stage and where it lands (chaosLayout), and when the faults
// strike (schedule).

var (
	chaosFull = flag.Bool("chaos.full", false,
		"run TestChaos at full size: 20,000 jobs/s for 90s under every kind of fault (see relay/README.md, How the guarantees are tested)")
	chaosRate = flag.Int("chaos.rate", 0,
		"jobs/s TestChaos's producers commit (0: the plan's, chaosFullRate or chaosShortRate)")
	chaosWindow = flag.Duration("chaos.window", 0,
		"how long TestChaos's producers commit, and its faults run (0: the plan's, chaosFullWindow or chaosShortWindow)")
	chaosOnly = flag.String("chaos.only", "",
		"run TestChaos with only these `faults` (comma-separated: kill, sigstop, pause-all, pause-solo, pg-restart, redis-kill, redis-stall, poison)")
	chaosEach = flag.Int("chaos.each", 0,
		"with -chaos.only: how many of each fault named (0: the plan's count)")
	chaosSchemas = flag.Int("chaos.schemas", 0,
		"run TestChaos's relays with --schemas over this many schemas (0: one schema, with --schema); TestChaosSchemas's default is chaosShortSchemas")
	chaosTarget = flag.String("chaos.target", "sidekiq",
		"the relays' --target: sidekiq; bullmq (jobs read from BullMQ's wait lists and delayed sets, prefix bull); or celery (whose lists are checked as Kombu names them; scheduled jobs held in PostgreSQL until due)")
	chaosSeed = flag.Int64("chaos.seed", 0,
		"run TestChaos with this `seed` (0: a new one): the seed a failing run printed gives the same plan, the same faults at the same times and the same transactions; what the machine's timing does with them differs")
	chaosLogs = flag.String("chaos.logs", "",
		"write each relay's output to `dir`/relay-N.log once TestChaos ends (a passing run shows none of it)")
)

// The load and the length of a TestChaos run, and of its longest faults.
const (
	chaosFullRate    = 20_000 // jobs/s committed: the rate at which black-box runs found duplicates (issue 15)
	chaosFullWindow  = 90 * time.Second
	chaosShortRate   = 2_000
	chaosShortWindow = 20 * time.Second

	// chaosPauseFor is how long pause-all and pause-solo hold the relays
	// stopped: longer than the relay's Redis read timeout, so a push in
	// flight when they stop has timed out when they resume.
	chaosPauseFor = 8 * time.Second
	// chaosStallMargin is how much longer than the relays' Redis read
	// timeout redis-stall holds Redis stopped: a push sent in the stall
	// times out, and a client that retries sends it again, before Redis
	// runs either.
	chaosStallMargin = 2 * time.Second

	// chaosSchemaPrefix names the schemas of a run with -chaos.schemas:
	// chaos_00, chaos_01..., which the relays' --schemas chaos_* finds.
	chaosSchemaPrefix = "chaos_"
	// chaosShortSchemas is how many schemas TestChaosSchemas drains.
	chaosShortSchemas = 20
)

// chaosPlan is the size of a TestChaos run.
type chaosPlan struct {
	name         string
	producers    int
	rate         int           // jobs/s the producers commit (planted poison aside)
	window       time.Duration // producers spread their commits, the controller its faults, over it
	deadline     time.Duration // the producers give up, and the test fails, if not done by then
	txMin, txMax int           // jobs per producer transaction

	faults map[string]int // how many of each kind (chaosFaultKinds)

	stopFor, pauseFor, pgDownFor, redisDownFor time.Duration
	redisStallFor                              time.Duration // set by newChaos: the relays' Redis read timeout + chaosStallMargin

	holdChance       float64 // of a transaction held open for holdMin to holdMax
	holdMin, holdMax time.Duration
}

// committed is how many jobs the producers commit, at least.
func (p chaosPlan) committed() int { return int(int64(p.rate) * int64(p.window) / int64(time.Second)) }

func chaosPlanFor(full bool) chaosPlan {
	if full {
		return chaosPlan{name: "full", producers: 6, rate: chaosFullRate, window: chaosFullWindow, deadline: 4 * time.Minute,
			txMin: 500, txMax: 1500,
			faults: map[string]int{"kill": 8, "sigstop": 2, "pause-all": 2, "pause-solo": 2, "pg-restart": 2,
				"redis-kill": 2, "redis-stall": 3, "poison": 4},
			stopFor: 3 * time.Second, pauseFor: chaosPauseFor, pgDownFor: time.Second, redisDownFor: 3 * time.Second,
			holdChance: 0.005, holdMin: time.Second, holdMax: 4 * time.Second}
	}
	return chaosPlan{name: "short", producers: 4, rate: chaosShortRate, window: chaosShortWindow, deadline: 60 * time.Second,
		txMin: 1, txMax: 100,
		faults:  map[string]int{"kill": 2, "sigstop": 1, "pg-restart": 1, "redis-kill": 1, "redis-stall": 1, "poison": 2},
		stopFor: 2 * time.Second, pauseFor: chaosPauseFor, pgDownFor: 500 * time.Millisecond, redisDownFor: 2 * time.Second,
		holdChance: 0.015, holdMin: time.Second, holdMax: 2 * time.Second}
}

// chaosPlanFromFlags is the plan of -chaos.full, with -chaos.rate,
// -chaos.window, -chaos.only and -chaos.each applied.
func chaosPlanFromFlags(t *testing.T) chaosPlan {
	t.Helper()
	plan := chaosPlanFor(*chaosFull)
	if *chaosRate > 0 {
		plan.rate = *chaosRate
	}
	if *chaosWindow > 0 {
		plan.window = *chaosWindow
		plan.deadline = max(plan.deadline, 2*plan.window+time.Minute)
	}
	if *chaosOnly != "" {
		only := make(map[string]int)
		for name := range strings.SplitSeq(*chaosOnly, ",") {
			name = strings.TrimSpace(name)
			if chaosFaultKind(name) == nil {
				t.Fatalf("-chaos.only: no fault %q (want some of %s)", name, strings.Join(chaosFaultNames(), ", "))
			}
			only[name] = cmp.Or(*chaosEach, plan.faults[name], 1)
		}
		plan.faults = only
		plan.name += " only " + *chaosOnly
	}
	return plan
}

// What the producers stage: jobs of these queues, some scheduled, in
// transactions of the plan's txMin to txMax jobs, some rolled back on
// purpose.
const (
	chaosRollbackChance   = 0.2
	chaosScheduledChance  = 0.1
	chaosWrongTypeQueue   = "chaos_wrongtype" // its key holds a string: LPUSH answers WRONGTYPE
	chaosMaxPayloadBytes  = 2048              // the relays' --max-payload-bytes
	chaosOversizedPadding = 3000              // bytes of padding in an oversized row
)

func chaosQueues() []string { return []string{"default", "critical", "mailers", "low"} }

// chaosLayout is where -chaos.target's jobs land: the list of a queue's
// immediate jobs, the sorted set of its scheduled ones (nil for a target
// that holds them in PostgreSQL until due, and pushes them to the list
// then), and how a scheduled job is staged.
type chaosLayout struct {
	target   string
	list     func(queue string) string
	schedule func(queue string) string
	runAt    string // SQL: a scheduled job's run_at
}

func chaosLayoutOf(t *testing.T) chaosLayout {
	switch *chaosTarget {
	case "sidekiq":
		return chaosLayout{target: "sidekiq", list: func(q string) string { return "queue:" + q },
			schedule: func(string) string { return "schedule" }, runAt: "now() + interval '1 hour'"}
	case "bullmq":
		// BullMQ's default prefix, bull: a queue's wait list and delayed set.
		return chaosLayout{target: "bullmq", list: func(q string) string { return "bull:" + q + ":wait" },
			schedule: func(q string) string { return "bull:" + q + ":delayed" }, runAt: "now() + interval '1 hour'"}
	case "celery":
		// Kombu's list of the queue (priority 0); due within the run.
		return chaosLayout{target: "celery", list: func(q string) string { return q },
			runAt: "now() + interval '3 seconds'"}
	}
	t.Fatalf("-chaos.target %q: want sidekiq, bullmq or celery", *chaosTarget)
	return chaosLayout{}
}

// scheduleKeys are the sorted sets of the queues' scheduled jobs, each once.
func (l chaosLayout) scheduleKeys() []string {
	var keys []string
	if l.schedule != nil {
		for _, q := range chaosQueues() {
			if k := l.schedule(q); !slices.Contains(keys, k) {
				keys = append(keys, k)
			}
		}
	}
	return keys
}

// queueOf returns the queue whose list key is, if it is one.
func (l chaosLayout) queueOf(key string) (string, bool) {
	for _, q := range append(chaosQueues(), chaosWrongTypeQueue) {
		if l.list(q) == key {
			return q, true
		}
	}
	return "", false
}

// chaosFaultCounts is counts by fault name, in chaosFaultKinds' order:
// kill=12 sigstop=2 ...
func chaosFaultCounts(counts map[string]int) string {
	var parts []string
	for _, name := range chaosFaultNames() {
		if n, ok := counts[name]; ok {
			part := fmt.Sprintf("%s=%d", name, n)
			if aimed := counts[name+":aimed"]; aimed > 0 {
				part += fmt.Sprintf("(%d aimed)", aimed)
			}
			parts = append(parts, part)
		}
	}
	return strings.Join(parts, " ")
}

// chaosEvent is one fault, at its offset from the producers' start.
type chaosEvent struct {
	at    time.Duration
	fault *chaosFault
}

// schedule spreads the plan's faults over the window in a random order,
// one to a slot: each fault's slot is its hold plus an even share of the
// window's free time, and it starts at a random point of the first half
// of that share.
func (c *chaos) schedule() []chaosEvent {
	var kinds []*chaosFault
	var held time.Duration
	for i := range chaosFaultKinds {
		k := &chaosFaultKinds[i]
		for range c.plan.faults[k.name] {
			kinds = append(kinds, k)
			held += k.hold(c.plan)
		}
	}
	if len(kinds) == 0 {
		return nil
	}
	c.rng.Shuffle(len(kinds), func(i, j int) { kinds[i], kinds[j] = kinds[j], kinds[i] })
	free := max(c.plan.window-held, c.plan.window/10)
	share := free / time.Duration(len(kinds))
	events := make([]chaosEvent, len(kinds))
	var at time.Duration
	for i, k := range kinds {
		events[i] = chaosEvent{at: at + share/8 + time.Duration(c.rng.Int64N(int64(share/2))), fault: k}
		at += share + k.hold(c.plan)
	}
	return events
}
