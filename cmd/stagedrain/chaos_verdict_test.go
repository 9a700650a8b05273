package main

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"

	"github.com/stagedrain/stagedrain/relay/relaytest"
)

// TestChaos's verdict: what it reads back (Redis, the ledger,
// staged_jobs_dead), the gaps in delivery, the figures and their checks.

// deliveryGap is the longest time the number of jobs in Redis stood still
// between two increases, and when that gap ended.
type deliveryGap struct {
	longest time.Duration
	endedAt time.Time
	spans   []gapSpan // every gap of a second or more
}

type gapSpan struct{ from, to time.Time }

// unplanned returns the longest time delivery stood still outside the
// faults' own windows (from a fault's start to its end: a SIGSTOP's or a
// stall's hold, a server's restart), and when that gap ended. A plan can
// line up stalls back to back (8s of every relay stopped, then 8s more,
// then Redis stopped twice for 7s: 30s in which nothing can be
// delivered); what is left of a gap outside them is the time the relays
// took to recover, which is what the verdict bounds.
func (g deliveryGap) unplanned(ran []chaosRun) (longest time.Duration, endedAt time.Time) {
	for _, s := range g.spans {
		left := s.to.Sub(s.from)
		// The faults' windows inside the gap, merged where they overlap.
		var ws []gapSpan
		for _, r := range ran {
			if r.fault == "poison" {
				continue
			}
			from, to := r.from, r.to
			if from.Before(s.from) {
				from = s.from
			}
			if to.After(s.to) {
				to = s.to
			}
			if from.Before(to) {
				ws = append(ws, gapSpan{from, to})
			}
		}
		slices.SortFunc(ws, func(a, b gapSpan) int { return a.from.Compare(b.from) })
		var covered time.Duration
		var end time.Time
		for _, w := range ws {
			if w.from.Before(end) {
				w.from = end
			}
			if w.from.Before(w.to) {
				covered += w.to.Sub(w.from)
				end = w.to
			}
		}
		if left -= covered; left > longest {
			longest, endedAt = left, s.to
		}
	}
	return longest, endedAt
}

// sampleDeliveries counts the jobs in the queues and the schedule every
// 20ms until ctx ends (errors, Redis down, count as no change).
func sampleDeliveries(ctx context.Context, port int, layout chaosLayout) deliveryGap {
	rdb := redis.NewClient(&redis.Options{Addr: fmt.Sprintf("127.0.0.1:%d", port), DisableIdentity: true,
		MaxRetries: -1, DialTimeout: 200 * time.Millisecond, ReadTimeout: 500 * time.Millisecond, PoolSize: 1})
	defer rdb.Close()
	var g deliveryGap
	var last int64
	var lastUp time.Time
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return g
		case <-tick.C:
		}
		var cmds []*redis.IntCmd
		_, err := rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
			for _, q := range chaosQueues() {
				cmds = append(cmds, p.LLen(ctx, layout.list(q)))
			}
			for _, k := range layout.scheduleKeys() {
				cmds = append(cmds, p.ZCard(ctx, k))
			}
			return nil
		})
		if err != nil {
			continue
		}
		var n int64
		for _, cmd := range cmds {
			n += cmd.Val()
		}
		if now := time.Now(); n > last {
			gap := now.Sub(lastUp)
			if !lastUp.IsZero() && gap > g.longest {
				g.longest, g.endedAt = gap, now
			}
			if !lastUp.IsZero() && gap >= time.Second {
				g.spans = append(g.spans, gapSpan{lastUp, now})
			}
			last, lastUp = n, now
		}
	}
}

// delivery is one job found in Redis.
type delivery struct {
	key      string // queue:<name> or schedule
	jid      string
	enqueued time.Time // when the relay pushed it (enqueued_at; zero for a scheduled job)
}

func (d delivery) String() string {
	if d.enqueued.IsZero() {
		return d.key + " jid " + d.jid
	}
	return d.key + " jid " + d.jid + " enqueued " + d.enqueued.Format("15:04:05.000")
}

// chaosReadItems starts chaosReadScript and chaosBullmqReadScript: items,
// ARGV[1] to ARGV[2] of the list (ARGV[3] "list") or zset KEYS[1], and out,
// the lines of the reply.
const chaosReadItems = `
local items
if ARGV[3] == 'list' then
  items = redis.call('LRANGE', KEYS[1], ARGV[1], ARGV[2])
else
  items = redis.call('ZRANGE', KEYS[1], ARGV[1], ARGV[2])
end
local out = {}
`

// chaosReadScript reads ARGV[1] to ARGV[2] of the list (ARGV[3] "list")
// or zset KEYS[1] and decodes each entry in Redis (cjson: a million
// payloads decode in seconds there, in minutes in a -race test binary):
// "marker TAB jid TAB queue TAB enqueued_at" for a chaos job (enqueued_at
// "" when the payload has none), "!" and the raw entry (its newlines as
// \n) for anything else. It answers how many entries it read, and their
// lines joined by newlines: one reply to parse, not one per entry.
var chaosReadScript = redis.NewScript(chaosReadItems + `for i, raw in ipairs(items) do
  local ok, job = pcall(cjson.decode, raw)
  local marker = ok and type(job) == 'table' and job.class == 'ChaosJob' and type(job.args) == 'table' and job.args[1]
  if type(marker) == 'string' and marker ~= '' and type(job.queue) == 'string' and type(job.jid) == 'string' and
     not (marker .. job.queue .. job.jid):find('[\t\n]') then
    local at = ''
    if type(job.enqueued_at) == 'number' then at = string.format('%.6f', job.enqueued_at) end
    out[i] = marker .. '\t' .. job.jid .. '\t' .. job.queue .. '\t' .. at
  else
    out[i] = '!' .. raw:gsub('\n', '\\n')
  end
end
return {#items, table.concat(out, '\n')}
`)

// chaosReadCeleryScript is chaosReadScript for Celery's task messages
// (-chaos.target celery): the marker is the first of the args, read from
// the headers' argsrepr (the args' JSON text; the body is the same text in
// base64, which the real-worker and golden tests check), the jid the
// task id, the queue delivery_info's routing_key; enqueued_at is "".
var chaosReadCeleryScript = redis.NewScript(`
local items = redis.call('LRANGE', KEYS[1], ARGV[1], ARGV[2])
local out = {}
for i, raw in ipairs(items) do
  local ok, m = pcall(cjson.decode, raw)
  local h = ok and type(m) == 'table' and m.headers
  local p = ok and type(m) == 'table' and m.properties
  local marker, queue, jid
  if type(h) == 'table' and h.task == 'ChaosJob' and type(h.argsrepr) == 'string' and type(p) == 'table' and
     type(p.delivery_info) == 'table' then
    local ok2, args = pcall(cjson.decode, h.argsrepr)
    marker = ok2 and type(args) == 'table' and args[1]
    queue, jid = p.delivery_info.routing_key, h.id
  end
  if type(marker) == 'string' and marker ~= '' and type(queue) == 'string' and type(jid) == 'string' and
     not (marker .. queue .. jid):find('[\t\n]') then
    out[i] = marker .. '\t' .. jid .. '\t' .. queue .. '\t'
  else
    out[i] = '!' .. raw:gsub('\n', '\\n')
  end
end
return {#items, table.concat(out, '\n')}
`)

// readDeliveries reads every job of Sidekiq's keys (the queue:* lists and
// the schedule zset; any other key, such as the relay's own bookkeeping,
// is not a delivery) by marker. Entries that are not a chaos job, and
// queue keys that are not lists (but the WRONGTYPE one), are returned as
// foreign.
func (c *chaos) readDeliveries() (map[string][]delivery, []string) {
	t, ctx := c.t, c.ctx
	byMarker := make(map[string][]delivery, c.plan.committed()+c.plan.committed()/8)
	var foreign []string
	add := func(key, entry string) {
		if raw, ok := strings.CutPrefix(entry, "!"); ok {
			foreign = append(foreign, key+": "+raw)
			return
		}
		marker, rest, ok1 := strings.Cut(entry, "\t")
		jid, rest, ok2 := strings.Cut(rest, "\t")
		queue, at, ok3 := strings.Cut(rest, "\t")
		if !ok1 || !ok2 || !ok3 {
			foreign = append(foreign, key+": "+entry)
			return
		}
		if q, ok := c.layout.queueOf(key); ok && queue != q {
			foreign = append(foreign, key+": queue "+queue+": "+marker+" jid "+jid)
			return
		}
		d := delivery{key: key, jid: jid}
		if at != "" {
			secs, err := strconv.ParseFloat(at, 64)
			if err != nil {
				t.Fatalf("%s: enqueued_at %q: %v", key, at, err)
			}
			if secs > 0 {
				d.enqueued = time.Unix(0, int64(secs*1e9))
			}
		}
		byMarker[marker] = append(byMarker[marker], d)
	}
	script := chaosReadScript
	if c.layout.target == "celery" {
		script = chaosReadCeleryScript
	}
	read := func(key, kind string) { c.readScript(script, kind, []string{key}, nil, add) }
	if c.layout.target == "bullmq" {
		c.readBullmqDeliveries(add)
		return byMarker, foreign
	}
	pattern := c.layout.list("*")
	keys, err := c.rdb.Keys(ctx, pattern).Result()
	if err != nil {
		t.Fatalf("KEYS %s: %v", pattern, err)
	}
	for _, key := range keys {
		if c.layout.target == "celery" && (strings.HasPrefix(key, "stagedrain:") || strings.HasPrefix(key, "_kombu.")) {
			continue // the relay's own keys (and no worker's) share the key space with Kombu's lists
		}
		typ, err := c.rdb.Type(ctx, key).Result()
		if err != nil {
			t.Fatalf("TYPE %s: %v", key, err)
		}
		switch {
		case typ == "list":
			read(key, "list")
		case key == c.layout.list(chaosWrongTypeQueue) && typ == "string":
		default:
			foreign = append(foreign, fmt.Sprintf("%s: a %s", key, typ))
		}
	}
	for _, k := range c.layout.scheduleKeys() {
		read(k, "zset")
	}
	return byMarker, foreign
}

// chaosBullmqReadScript reads ARGV[1] to ARGV[2] of the wait list (ARGV[3]
// "list") or delayed zset KEYS[1] of the BullMQ queue whose keys start
// KEYS[2] (bull:<queue>:), as chaosReadScript does Sidekiq's: each entry is
// a job id, its job hash <prefix><id> holds the name and data (whose first
// element is the marker). The queue is the key's.
var chaosBullmqReadScript = redis.NewScript(chaosReadItems + `for i, id in ipairs(items) do
  local h = redis.call('HMGET', KEYS[2] .. id, 'name', 'data')
  local ok, data = pcall(cjson.decode, h[2] or '')
  local marker = ok and h[1] == 'ChaosJob' and type(data) == 'table' and data[1]
  if type(marker) == 'string' and marker ~= '' and not (marker .. id):find('[\t\n]') then
    out[i] = marker .. '\t' .. id .. '\t' .. ARGV[4] .. '\t'
  else
    out[i] = '!' .. id .. ' ' .. tostring(h[1]) .. ' ' .. tostring(h[2])
  end
end
return {#items, table.concat(out, '\n')}
`)

// readBullmqDeliveries reads every job of the BullMQ queues' wait lists
// and delayed sets into add. The job
// key guards a BullMQ add, so a second push of a job is a no-op there: the
// queues' job counters (<prefix>:<queue>:id, one INCR per add that ran)
// must then add up to the jobs found, or a job was added twice.
func (c *chaos) readBullmqDeliveries(add func(key, entry string)) {
	t, ctx := c.t, c.ctx
	var found, adds int64
	for _, q := range chaosQueues() {
		for _, kind := range []string{"list", "zset"} {
			key := c.layout.list(q)
			if kind == "zset" {
				key = c.layout.schedule(q)
			}
			found += c.readScript(chaosBullmqReadScript, kind, []string{key, "bull:" + q + ":"}, []any{q}, add)
		}
		n, err := c.rdb.Get(ctx, "bull:"+q+":id").Int64()
		if err != nil && !errors.Is(err, redis.Nil) {
			t.Fatalf("GET bull:%s:id: %v", q, err)
		}
		adds += n
	}
	if adds != found {
		t.Errorf("BullMQ's job counters count %d adds, for %d jobs in the queues: a job was added twice", adds, found)
	}
	c.note("bullmq: %d jobs found, %d adds counted", found, adds)
}

// readScript reads the entries of KEYS[1] of keys (kind: "list" or "zset")
// with script (chaosReadScript and the like), chaosReadChunk at a time,
// its ARGV the range, kind, then extra; it hands add each line of the
// replies and returns how many entries it read.
func (c *chaos) readScript(script *redis.Script, kind string, keys []string, extra []any, add func(key, entry string)) int64 {
	var found int64
	for i := int64(0); ; i += chaosReadChunk {
		reply, err := script.Run(c.ctx, c.rdb, keys, append([]any{i, i + chaosReadChunk - 1, kind}, extra...)...).Slice()
		if err != nil {
			c.t.Fatalf("read %s %s: %v", kind, keys[0], err)
		}
		n, _ := reply[0].(int64)
		lines, _ := reply[1].(string)
		for got := int64(0); got < n; got++ {
			var entry string
			entry, lines, _ = strings.Cut(lines, "\n")
			add(keys[0], entry)
		}
		found += n
		if n < chaosReadChunk {
			return found
		}
	}
}

// chaosReadChunk is how many entries a read script reads at a time.
const chaosReadChunk = 10_000

// readDead returns the markers of staged_jobs_dead's rows (of every
// schema), each with its reason and attempts; in a fleet, "in <schema>"
// before them.
func (c *chaos) readDead() map[string]string {
	rows, err := c.db().Query(c.ctx, c.tables("staged_jobs_dead", "job_args->>0, reason, attempts", true))
	if err != nil {
		c.t.Fatalf("read staged_jobs_dead: %v", err)
	}
	dead := make(map[string]string)
	var schema, marker, reason string
	var attempts int
	_, err = pgx.ForEachRow(rows, []any{&schema, &marker, &reason, &attempts}, func() error {
		if _, twice := dead[marker]; twice {
			return fmt.Errorf("%s dead-lettered twice (again in %s)", marker, schema)
		}
		dead[marker] = c.deadReason(schema, attempts, reason)
		return nil
	})
	if err != nil {
		c.t.Fatalf("read staged_jobs_dead: %v", err)
	}
	return dead
}

// deadReason is what readDead says of a dead row: "attempts 1: reason",
// after "in <schema>: " in a fleet.
func (c *chaos) deadReason(schema string, attempts int, reason string) string {
	s := fmt.Sprintf("attempts %d: %s", attempts, reason)
	if c.fleet {
		s = "in " + schema + ": " + s
	}
	return s
}

// readLedger returns the ids of the transactions that committed (in every
// schema).
func (c *chaos) readLedger() map[string]bool {
	rows, err := c.db().Query(c.ctx, c.tables("chaos_ledger", "tx", false))
	if err != nil {
		c.t.Fatalf("read the ledger: %v", err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		c.t.Fatalf("read the ledger: %v", err)
	}
	committed := make(map[string]bool, len(ids))
	for _, id := range ids {
		committed[id] = true
	}
	return committed
}

// chaosFigures is what a run found; check judges it.
type chaosFigures struct {
	plan    string
	seed    int64
	rate    int
	window  time.Duration
	elapsed time.Duration

	txs, txsCommitted, txsRolledBack, txsFailed int
	inDoubt, inDoubtCommitted                   int // transactions whose COMMIT failed in flight, and of those, committed
	committed, rolledBack                       int // jobs (poison aside)

	delivered           int // entries of chaos jobs in Redis
	lost                int // committed jobs not in Redis
	duplicates          int // entries beyond the first of a committed job's jid (or of the job, under another jid)
	duplicatedJobs      int // committed jobs in Redis more than once
	rejids              int // entries of a committed job under a jid other than its first: pushed again as a new job
	rolledBackDelivered int // entries of jobs that never committed
	unstaged            int // entries of chaos jobs that no producer staged
	misplaced           int // entries of a job in the wrong queue, or scheduled when not (or not when)

	planted   int // poison rows committed
	dead      int // rows in staged_jobs_dead
	deadWrong []string

	stagedLeft    int
	leaderChanges int // relays that became leader after the first
	faults        map[string]int
	gap           deliveryGap
	gapAt         time.Duration // when the longest gap ended, from the producers' start
	unplanned     time.Duration // the longest gap outside the faults' windows (deliveryGap.unplanned)
	unplannedAt   time.Duration // when it ended, from the producers' start

	duplicateCauses []string       // duplicates grouped by when they were pushed
	duplicatesBy    map[string]int // duplicates by the fault under way when the job was first pushed ("none": no fault)

	ledgerWrong []string // a transaction whose outcome the ledger contradicts
	foreign     []string // entries in Redis that are no chaos job, or keys of the wrong type
	samples     map[string][]string
	problems    []string // what check found wrong
}

func (f *chaosFigures) sample(kind, s string) {
	if len(f.samples[kind]) < 10 {
		f.samples[kind] = append(f.samples[kind], s)
	}
}

// verdict stops the relays (SIGTERM: each must exit 0) and gathers the
// figures from the producers' records, the ledger, Redis and PostgreSQL.
func (c *chaos) verdict() *chaosFigures {
	t := c.t
	f := &chaosFigures{plan: c.plan.name, seed: c.seed, rate: c.plan.rate, window: c.plan.window,
		faults: c.faults, gap: c.gap, samples: make(map[string][]string)}
	if !c.gap.endedAt.IsZero() {
		f.gapAt = c.gap.endedAt.Sub(c.start)
		var at time.Time
		if f.unplanned, at = c.gap.unplanned(c.ran); !at.IsZero() {
			f.unplannedAt = at.Sub(c.start)
		}
	}
	// A relay started by the last fault may not have installed its signal
	// handler yet (it does before its first line, "starting"), and would
	// die of the signal: wait for that line first.
	for _, p := range c.live {
		relaytest.WaitFor(t, 30*time.Second, p.name+" to log starting", func() (bool, string) {
			return p.count(rootLogger, "starting") > 0, "no starting line yet"
		})
	}
	for _, p := range c.live {
		p.signal(syscall.SIGTERM)
	}
	for _, p := range c.live {
		if code := p.wait(20 * time.Second); code != 0 {
			f.fail(t, "%s exited with code %d after SIGTERM, want 0", p.name, code)
		}
	}
	f.elapsed = time.Since(c.start)
	for _, p := range c.relays {
		f.leaderChanges += p.count(rootLogger, "became leader")
	}
	f.leaderChanges -= len(c.schemas) // the first leader (of each schema)

	c.note("relays stopped")
	ledger := c.readLedger()
	deliveries, foreign := c.readDeliveries()
	c.note("read %d jobs' entries from Redis", len(deliveries))
	f.foreign = foreign
	dead := c.readDead()
	f.dead = len(dead)
	var err error
	if f.stagedLeft, err = c.staged(); err != nil {
		t.Fatalf("count staged_jobs: %v", err)
	}

	var dups [][]delivery
	for _, tx := range c.txs {
		f.txs++
		committed := ledger[tx.id]
		switch tx.outcome {
		case txCommitted:
			f.txsCommitted++
			if !committed {
				f.ledgerWrong = append(f.ledgerWrong, tx.id+": COMMIT succeeded, but its ledger row is gone")
			}
		case txRolledBack, txFailed:
			if tx.outcome == txRolledBack {
				f.txsRolledBack++
			} else {
				f.txsFailed++
			}
			if committed {
				f.ledgerWrong = append(f.ledgerWrong, tx.id+": "+tx.outcome.String()+", but its ledger row is there")
			}
		case txInDoubt:
			f.inDoubt++
			if committed {
				f.inDoubtCommitted++
			}
		}
		for _, j := range tx.jobs {
			got := deliveries[j.marker]
			delete(deliveries, j.marker)
			f.delivered += len(got)
			want := c.layout.list(j.queue)
			if j.scheduled && c.layout.schedule != nil {
				want = c.layout.schedule(j.queue)
			}
			for _, d := range got {
				if d.key != want {
					f.misplaced++
					f.sample("misplaced", fmt.Sprintf("%s in %s, want %s", j.marker, d.key, want))
				}
			}
			switch {
			case j.poison != "":
				if committed {
					f.planted++
					reason, ok := dead[j.marker]
					delete(dead, j.marker)
					wantReason := map[string]string{"oversize": "over the limit", "wrongtype": "WRONGTYPE"}[j.poison]
					if want := c.deadReason(tx.schema, 1, ""); !ok || !strings.HasPrefix(reason, want) || !strings.Contains(reason, wantReason) {
						f.deadWrong = append(f.deadWrong, fmt.Sprintf("planted %s (%s): dead row %q, want %q and a reason with %q", j.marker, j.poison, reason, want, wantReason))
					}
				}
				if len(got) > 0 {
					f.deadWrong = append(f.deadWrong, fmt.Sprintf("planted %s (%s) is in Redis %d times", j.marker, j.poison, len(got)))
				}
			case committed:
				f.committed++
				switch {
				case len(got) == 0:
					f.lost++
					f.sample("lost", fmt.Sprintf("%s (transaction %s)", j.marker, tx.outcome))
				case len(got) > 1:
					// Exactly: every entry beyond the first of the job's
					// jid is a duplicate, and so is an entry of the job
					// under any other jid.
					f.duplicates += len(got) - 1
					f.duplicatedJobs++
					for _, d := range got[1:] {
						if d.jid != got[0].jid {
							f.rejids++
						}
					}
					f.sample("duplicate", fmt.Sprintf("%s x%d %v", j.marker, len(got), got))
					dups = append(dups, got)
				}
			default:
				f.rolledBack++
				if len(got) > 0 {
					f.rolledBackDelivered += len(got)
					f.sample("rolled back delivered", fmt.Sprintf("%s (transaction %s) %v", j.marker, tx.outcome, got))
				}
			}
		}
	}
	for marker, got := range deliveries {
		f.unstaged += len(got)
		f.foreign = append(f.foreign, fmt.Sprintf("%s: no such job staged, delivered %v", marker, got))
	}
	for marker, reason := range dead {
		f.deadWrong = append(f.deadWrong, fmt.Sprintf("%s in staged_jobs_dead (%s), never planted", marker, reason))
	}
	slices.Sort(f.deadWrong)
	f.duplicateCauses, f.duplicatesBy = c.duplicateCauses(dups)
	c.note("figures done")
	return f
}

// duplicateCauses groups duplicated jobs by when they were pushed first and
// last (to 10ms), naming what the timeline holds in between, and counts
// the duplicate entries by the fault under way when the job was first
// pushed: one that started at most chaosBlameBefore later (a push in flight
// when it struck) or ended at most chaosBlameAfter earlier.
func (c *chaos) duplicateCauses(dups [][]delivery) ([]string, map[string]int) {
	type span struct{ first, last time.Time }
	count := make(map[span]int)
	entries := make(map[span]int)
	for _, got := range dups {
		var sp span
		for _, d := range got {
			if d.enqueued.IsZero() {
				continue
			}
			if t := d.enqueued.Truncate(10 * time.Millisecond); sp.first.IsZero() || t.Before(sp.first) {
				sp.first = t
			}
			if t := d.enqueued.Truncate(10 * time.Millisecond); t.After(sp.last) {
				sp.last = t
			}
		}
		count[sp]++
		entries[sp] += len(got) - 1
	}
	spans := slices.SortedFunc(maps.Keys(count), func(a, b span) int { return a.first.Compare(b.first) })
	var out []string
	by := make(map[string]int)
	for _, sp := range spans {
		blamed := "none"
		for _, r := range c.ran {
			if !sp.first.Before(r.from.Add(-chaosBlameBefore)) && !sp.first.After(r.to.Add(chaosBlameAfter)) {
				blamed = r.fault
				break
			}
		}
		by[blamed] += entries[sp]
		out = append(out, fmt.Sprintf("%d jobs pushed at %s and again at %s (during %s), in between: %s",
			count[sp], c.offset(sp.first), c.offset(sp.last), blamed, strings.Join(c.between(sp.first, sp.last.Add(10*time.Millisecond)), "; ")))
	}
	return out, by
}

// A duplicate is blamed on a fault that started up to chaosBlameBefore
// after the job's first push (its enqueued_at, set as the batch was built:
// the fault struck the push in flight) or ended up to chaosBlameAfter
// before it.
const (
	chaosBlameBefore = time.Second
	chaosBlameAfter  = 100 * time.Millisecond
)

// chaosBlameCounts is duplicatesBy as redis-stall=27 pause-all=300, in
// chaosFaultKinds' order, "none" last; "-" when there are none.
func chaosBlameCounts(by map[string]int) string {
	var parts []string
	for _, name := range append(chaosFaultNames(), "none") {
		if n := by[name]; n > 0 {
			parts = append(parts, fmt.Sprintf("%s=%d", name, n))
		}
	}
	if len(parts) == 0 {
		return "-"
	}
	return strings.Join(parts, " ")
}

// phantom is the entries in Redis of chaos jobs that never committed:
// rolled back, failed, or never staged at all.
func (f *chaosFigures) phantom() int { return f.rolledBackDelivered + f.unstaged }

// summary is the run's figures on one line, the faults last (as many of
// each kind as ran).
func (f *chaosFigures) summary() string {
	return fmt.Sprintf("chaos %s seed=%d rate=%d/s window=%s: committed=%d delivered=%d lost=%d duplicates=%d duplicated_jobs=%d phantom=%d "+
		"rolled_back=%d in_doubt_txs=%d(%d committed) misplaced=%d dead=%d planted=%d staged_left=%d leader_changes=%d "+
		"longest_gap=%.2fs(ended +%.1fs) elapsed=%.1fs duplicates_by_fault: %s faults: %s",
		f.plan, f.seed, f.rate, f.window, f.committed, f.delivered, f.lost, f.duplicates, f.duplicatedJobs, f.phantom(),
		f.rolledBack, f.inDoubt, f.inDoubtCommitted, f.misplaced, f.dead, f.planted, f.stagedLeft, f.leaderChanges,
		f.gap.longest.Seconds(), f.gapAt.Seconds(), f.elapsed.Seconds(), chaosBlameCounts(f.duplicatesBy), chaosFaultCounts(f.faults))
}

func (f *chaosFigures) log(t *testing.T) {
	t.Helper()
	t.Logf("transactions: %d (%d committed, %d rolled back on purpose, %d failed before COMMIT, %d in doubt of which %d committed)",
		f.txs, f.txsCommitted, f.txsRolledBack, f.txsFailed, f.inDoubt, f.inDoubtCommitted)
	t.Logf("jobs committed: %d; rolled back or never committed: %d; delivered (entries in Redis): %d", f.committed, f.rolledBack, f.delivered)
	t.Logf("lost: %d; duplicates: %d (of %d jobs; %d under a jid of their own); phantom: %d (%d rolled back or failed, %d never staged); misplaced: %d",
		f.lost, f.duplicates, f.duplicatedJobs, f.rejids, f.phantom(), f.rolledBackDelivered, f.unstaged, f.misplaced)
	if len(f.duplicateCauses) > 0 {
		t.Logf("duplicates by when they were pushed (scheduled jobs pushed twice do not show: the schedule zset holds one copy):\n  %s", strings.Join(f.duplicateCauses, "\n  "))
	}
	t.Logf("dead letters: %d (planted %d); left staged: %d", f.dead, f.planted, f.stagedLeft)
	t.Logf("faults: %s; leader changes: %d", chaosFaultCounts(f.faults), f.leaderChanges)
	t.Logf("longest gap in delivery: %s (ended %.1fs after the producers started); outside the faults' windows: %s (ended %.1fs); elapsed: %s",
		f.gap.longest.Round(time.Millisecond), f.gapAt.Seconds(), f.unplanned.Round(time.Millisecond), f.unplannedAt.Seconds(), f.elapsed.Round(time.Millisecond))
	t.Log(f.summary())
}

// check fails the test for whatever the figures show went wrong.
func (f *chaosFigures) check(t *testing.T) {
	t.Helper()
	fail := func(format string, args ...any) { f.fail(t, format, args...) }
	if f.lost != 0 {
		fail("%d committed jobs never reached Redis, want none; some: %v", f.lost, f.samples["lost"])
	}
	checkExactlyOnce(t, f)
	if f.rolledBackDelivered != 0 {
		fail("%d entries in Redis of jobs that never committed, want none; some: %v", f.rolledBackDelivered, f.samples["rolled back delivered"])
	}
	if f.misplaced != 0 {
		fail("%d jobs in the wrong queue or schedule; some: %v", f.misplaced, f.samples["misplaced"])
	}
	if len(f.foreign) != 0 {
		fail("%d entries in Redis that no producer staged (or keys of the wrong type), want none; some: %v", len(f.foreign), f.foreign[:min(10, len(f.foreign))])
	}
	if f.stagedLeft != 0 {
		fail("%d rows left in staged_jobs, want none", f.stagedLeft)
	}
	if (f.faults["poison"] > 0 && f.planted == 0) || f.dead != f.planted || len(f.deadWrong) != 0 {
		fail("staged_jobs_dead holds %d rows, want exactly the %d planted (and some planted); wrong: %v", f.dead, f.planted, f.deadWrong)
	}
	if len(f.ledgerWrong) != 0 {
		fail("the ledger contradicts what the producers saw: %v", f.ledgerWrong)
	}
	// Faults stall delivery for their whole hold (a SIGSTOP of every
	// relay, Redis stopped), and a plan may line several up; outside them,
	// a relay that stays stuck this long is not recovering on its own.
	if f.unplanned > 30*time.Second {
		fail("delivery stood still for %s outside the faults' windows (longest gap %s), want under 30s", f.unplanned, f.gap.longest)
	}
}

// checkExactlyOnce is the exactly-once assertion: no committed job in Redis
// twice (the same jid pushed again after a fault). Everything else (none
// lost, none delivered after a rollback) is checked apart, so a run shows
// duplicates as a figure of their own.
func checkExactlyOnce(t *testing.T, f *chaosFigures) {
	t.Helper()
	if f.duplicates != 0 {
		f.fail(t, "%d duplicate entries of committed jobs in Redis, want none (exactly once); some: %v", f.duplicates, f.samples["duplicate"])
	}
}

// fail fails the test with the message, and keeps it in f.problems for
// the verdict repeated after the relays' output (testChaos).
func (f *chaosFigures) fail(t *testing.T, format string, args ...any) {
	t.Helper()
	msg := fmt.Sprintf(format, args...)
	f.problems = append(f.problems, msg)
	t.Error(msg)
}

// The chaos verdict bounds how long delivery stood still outside the
// faults' own windows: overlapping windows count once, a poison plant
// (no hold) not at all, and a gap's part before or after them does.
func TestDeliveryGapOutsideFaults(t *testing.T) {
	t0 := time.Unix(1000, 0)
	at := func(s float64) time.Time { return t0.Add(time.Duration(s * float64(time.Second))) }
	g := deliveryGap{spans: []gapSpan{
		{at(10), at(45)}, // 35s: faults cover 12-20, 18-30 (merged: 12-30) and 40-50 (40-45): 23s; 12s left
		{at(60), at(75)}, // 15s: only a poison plant inside: 15s left
	}}
	ran := []chaosRun{
		{fault: "pause-all", from: at(12), to: at(20)},
		{fault: "redis-stall", from: at(18), to: at(30)},
		{fault: "sigstop", from: at(40), to: at(50)},
		{fault: "poison", from: at(61), to: at(70)},
	}
	longest, ended := g.unplanned(ran)
	if longest != 15*time.Second || !ended.Equal(at(75)) {
		t.Errorf("unplanned = %s ending at +%s, want 15s ending at +75s", longest, ended.Sub(t0))
	}
	g.spans = g.spans[:1]
	if longest, _ := g.unplanned(ran); longest != 12*time.Second {
		t.Errorf("unplanned = %s, want 12s (35s less 18s and 5s of faults)", longest)
	}
}
