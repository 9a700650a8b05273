package main

import (
	"fmt"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"

	"github.com/stagedrain/stagedrain/relay/admin"
	"github.com/stagedrain/stagedrain/relay/relaytest"
)

// TestChaos's faults: the kinds (chaosFaultKinds), finding the leader they
// strike, and the controller's methods that run each one.

// chaosFault is a kind of fault: its name (in -chaos.only and the
// figures), what it holds for (to schedule the faults over the window),
// and the controller's method that runs one.
type chaosFault struct {
	name string
	hold func(chaosPlan) time.Duration
	do   func(*chaos)
}

var chaosFaultKinds = []chaosFault{
	// SIGKILL the leader, start a new relay.
	{"kill", func(chaosPlan) time.Duration { return time.Second }, (*chaos).killLeader},
	// SIGSTOP the leader for stopFor while the standby takes over.
	{"sigstop", func(p chaosPlan) time.Duration { return p.stopFor }, (*chaos).stopLeader},
	// SIGSTOP every relay at once for pauseFor (a paused VM: nobody can
	// take over), then SIGCONT them all.
	{"pause-all", func(p chaosPlan) time.Duration { return p.pauseFor }, (*chaos).pauseAll},
	// Stop the standby (SIGTERM), SIGSTOP the leader for pauseFor with
	// nobody to take over, SIGCONT it, start a new standby.
	{"pause-solo", func(p chaosPlan) time.Duration { return p.pauseFor + time.Second }, (*chaos).pauseSolo},
	// Stop PostgreSQL (fast), start it pgDownFor later.
	{"pg-restart", func(p chaosPlan) time.Duration { return p.pgDownFor + time.Second }, (*chaos).restartPostgres},
	// SIGKILL Redis, start it on its port redisDownFor later.
	{"redis-kill", func(p chaosPlan) time.Duration { return p.redisDownFor + time.Second }, (*chaos).killRedis},
	// SIGSTOP Redis for redisStallFor (its clients' read timeout and
	// more), then SIGCONT it.
	{"redis-stall", func(p chaosPlan) time.Duration { return p.redisStallFor }, (*chaos).stallRedis},
	// A transaction with two rows the relay must dead-letter.
	{"poison", func(chaosPlan) time.Duration { return 0 }, (*chaos).plantPoison},
}

func chaosFaultKind(name string) *chaosFault {
	for i := range chaosFaultKinds {
		if chaosFaultKinds[i].name == name {
			return &chaosFaultKinds[i]
		}
	}
	return nil
}

func chaosFaultNames() []string {
	var names []string
	for _, k := range chaosFaultKinds {
		names = append(names, k.name)
	}
	return names
}

// relayReadTimeout is the read timeout of `stagedrain run`'s Redis client
// for url, after go-redis's defaults (5s in go-redis 9.23).
func relayReadTimeout(t *testing.T, url string) time.Duration {
	t.Helper()
	opts, err := runRedisOptions(url)
	if err != nil {
		t.Fatal(err)
	}
	rdb := redis.NewClient(opts) // dials nothing until used
	defer rdb.Close()
	return rdb.Options().ReadTimeout
}

// leader waits until one of the live relays holds the leader lock, and
// returns its slot. In a fleet (-chaos.schemas) each relay leads a share
// of the schemas: the leader is the live relay that leads the most of
// them, once at least one does; on a tie (two relays with half each, the
// usual case) a random one of the two, so that kills in a row do not
// always strike the relay just started in the place of the last one.
func (c *chaos) leader() int {
	c.t.Helper()
	if c.fleet {
		return c.fleetLeader()
	}
	slot := -1
	relaytest.WaitFor(c.t, 30*time.Second, "a live relay to lead", func() (bool, string) {
		groups, err := admin.ReadGroups(c.ctx, c.db(), c.schemas[0])
		if err != nil {
			return false, err.Error()
		}
		if len(groups) == 0 || groups[0].Leader == nil {
			return false, "no session holds the leader lock"
		}
		l := groups[0].Leader // the relays of every queue: the only group
		for i, p := range c.live {
			if p.cmd.Process.Pid == l.PID {
				slot = i
				return true, ""
			}
		}
		return false, fmt.Sprintf("the lock is held by %q, not a live relay", l.ApplicationName)
	})
	return slot
}

// fleetLeadersSQL returns, for each schema of $1 whose leader lock (of
// every queue) a session holds, the pid in that session's application_name
// ("stagedrain leader <host>:<pid>"; 0 for another session).
const fleetLeadersSQL = `SELECT coalesce((regexp_match(a.application_name, '^stagedrain leader .*:([0-9]+)$'))[1]::int, 0)
	FROM unnest($1::text[]) AS s
	JOIN pg_locks l ON l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted
	  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
	  AND (l.classid::bigint << 32 | l.objid::bigint) = hashtextextended('stagedrain:' || s, 0)
	JOIN pg_stat_activity a ON a.pid = l.pid`

// led counts the schemas each live relay leads (by slot), and returns
// them with a description of who leads what.
func (c *chaos) led() (counts [2]int, others int, desc string, err error) {
	// One statement for every schema: the driver polls this, and each
	// read of pg_locks takes every lock partition, holding up the relays'
	// and the producers' own locks (admin.ReadGroups per schema, two reads
	// each, stalled delivery for 45s in a fleet of 20).
	rows, err := c.db().Query(c.ctx, fleetLeadersSQL, c.schemas)
	if err != nil {
		return counts, 0, "", err
	}
	pids, err := pgx.CollectRows(rows, pgx.RowTo[int])
	if err != nil {
		return counts, 0, "", err
	}
	for _, pid := range pids {
		i := slices.IndexFunc(c.live[:], func(p *proc) bool { return p != nil && p.cmd.Process.Pid == pid })
		if i < 0 {
			others++
			continue
		}
		counts[i]++
	}
	desc = fmt.Sprintf("of %d schemas, %d led by %s, %d by %s, %d by another session, %d by none",
		len(c.schemas), counts[0], c.liveName(0), counts[1], c.liveName(1), others, len(c.schemas)-len(pids))
	return counts, others, desc, nil
}

func (c *chaos) liveName(i int) string {
	if c.live[i] == nil {
		return "nobody"
	}
	return c.live[i].name
}

// waitLed waits until the counts of schemas the live relays lead satisfy
// ok.
func (c *chaos) waitLed(ok func(counts [2]int) bool, what string) {
	c.t.Helper()
	relaytest.WaitFor(c.t, 30*time.Second, what, func() (bool, string) {
		counts, _, desc, err := c.led()
		if err != nil {
			return false, err.Error()
		}
		return ok(counts), desc
	})
}

// waitBalanced waits until the two live relays lead every schema between
// them, each its share.
func (c *chaos) waitBalanced() {
	c.t.Helper()
	share := (len(c.schemas) + 1) / 2
	c.waitLed(func(counts [2]int) bool {
		return counts[0]+counts[1] == len(c.schemas) && counts[0] <= share && counts[1] <= share
	}, "the two relays to share the schemas")
}

// fleetLeader is leader in a fleet: the live relay that leads the most
// schemas.
func (c *chaos) fleetLeader() int {
	c.t.Helper()
	slot := -1
	relaytest.WaitFor(c.t, 30*time.Second, "a live relay to lead", func() (bool, string) {
		counts, _, desc, err := c.led()
		if err != nil {
			return false, err.Error()
		}
		if counts[0] == 0 && counts[1] == 0 {
			return false, desc
		}
		switch {
		case counts[0] > counts[1]:
			slot = 0
		case counts[1] > counts[0]:
			slot = 1
		default:
			slot = c.rng.IntN(2)
		}
		c.note("%s", desc)
		return true, ""
	})
	return slot
}

// killLeader SIGKILLs the leader and starts a new relay in its place.
func (c *chaos) killLeader() {
	c.t.Helper()
	i := c.leader()
	p := c.live[i]
	if err := p.cmd.Process.Kill(); err != nil {
		c.t.Fatalf("SIGKILL %s: %v", p.name, err)
	}
	c.note("SIGKILL %s, the leader", p.name)
	if code := p.wait(10 * time.Second); code != -1 {
		c.t.Errorf("%s exited with code %d, want death by SIGKILL", p.name, code)
	}
	c.live[i] = c.startRelay()
}

// stopLeader freezes the leader with SIGSTOP, and thaws it later.
func (c *chaos) stopLeader() {
	c.t.Helper()
	p := c.live[c.leader()]
	c.outage(func() { p.signal(syscall.SIGSTOP) }, "SIGSTOP "+p.name+", the leader", c.plan.stopFor,
		func() { p.signal(syscall.SIGCONT) }, "SIGCONT "+p.name)
}

// pauseAll freezes every live relay at once with SIGSTOP, as a paused VM
// would (nobody is left to take over), and thaws them pauseFor later.
//
// Every other one (the first, the third...) is aimed (aimAtPush): it
// strikes while the leader's push script waits in Redis, which runs it
// once the relays are frozen. The leader wakes with the reply in its
// socket and its read deadline long past: Go's runtime hands it the
// reply or a timeout, whichever it sees first (a timeout about half the
// time here). Redis is let go before the relays thaw, not after: a relay
// that times out closes its connection, and Redis drops a paused
// client's command when the client goes.
func (c *chaos) pauseAll() {
	c.t.Helper()
	release := c.aim("pause-all")
	for _, p := range c.live {
		p.signal(syscall.SIGSTOP)
	}
	c.note("SIGSTOP %s and %s, every relay", c.live[0].name, c.live[1].name)
	release()
	c.pause(c.plan.pauseFor)
	for _, p := range c.live {
		p.signal(syscall.SIGCONT)
	}
	c.note("SIGCONT %s and %s", c.live[0].name, c.live[1].name)
}

// pauseSolo stops the standby (SIGTERM: it must exit 0), freezes the
// leader, alone now, with SIGSTOP, thaws it pauseFor later and starts a
// new standby. Every other one is aimed, as pauseAll's.
func (c *chaos) pauseSolo() {
	c.t.Helper()
	i := c.leader()
	lead, standby := c.live[i], c.live[1-i]
	standby.signal(syscall.SIGTERM)
	if code := standby.wait(20 * time.Second); code != 0 {
		c.t.Errorf("%s, the standby, exited with code %d after SIGTERM, want 0", standby.name, code)
	}
	c.note("SIGTERM %s, the standby: exited", standby.name)
	if c.fleet {
		// Alone, it takes the schemas the other led: every one, before
		// it is frozen with nobody to take over.
		c.waitLed(func(counts [2]int) bool { return counts[i] == len(c.schemas) }, lead.name+" to lead every schema alone")
		c.note("%s leads every schema", lead.name)
	}
	release := c.aim("pause-solo")
	lead.signal(syscall.SIGSTOP)
	c.note("SIGSTOP %s, the leader, alone", lead.name)
	release()
	c.pause(c.plan.pauseFor)
	lead.signal(syscall.SIGCONT)
	c.note("SIGCONT %s", lead.name)
	c.live[1-i] = c.startRelay()
}

// aim aims the odd-numbered faults of this kind (the first, the third...)
// at a push in flight (aimAtPush), counting those it aimed as
// "<fault>:aimed", and returns what ends the aiming once the fault has
// struck.
func (c *chaos) aim(fault string) (release func()) {
	if c.faults[fault]%2 == 0 {
		return func() {}
	}
	release, ok := c.aimAtPush()
	if ok {
		c.faults[fault+":aimed"]++
	}
	return release
}

// aimAtPush holds the next push in Redis, so that a SIGSTOP of the relays
// lands while the push is in flight: the leader has sent its script and
// waits for the reply, with its read deadline running. It pauses Redis's
// writes (CLIENT PAUSE WRITE: a script that may write waits, reads do not)
// and waits (up to chaosAimWait) until CLIENT LIST shows a relay's EVALSHA
// of a batch (over 1,000 bytes of arguments) held there; a smaller script
// held (a new leader taking the fence) is let through, and Redis paused
// again. It returns what unpauses Redis, which the caller calls once the
// relays are frozen (the pause ends by itself 2s after it began). ok is
// false, and Redis unpaused, if no push came.
func (c *chaos) aimAtPush() (release func(), ok bool) {
	c.t.Helper()
	unpause := func() {
		if err := c.rdb.Do(c.ctx, "CLIENT", "UNPAUSE").Err(); err != nil {
			c.t.Errorf("CLIENT UNPAUSE: %v", err)
		}
	}
	pause := func() bool {
		if err := c.rdb.Do(c.ctx, "CLIENT", "PAUSE", 2000, "WRITE").Err(); err != nil {
			c.t.Errorf("CLIENT PAUSE: %v", err)
			return false
		}
		return true
	}
	// held reports whether a relay's push script waits in Redis, and
	// whether another of its scripts does.
	held := func() (push, other bool) {
		list, err := c.rdb.ClientList(c.ctx).Result()
		if err != nil {
			return false, false
		}
		for line := range strings.SplitSeq(list, "\n") {
			f := strings.Fields(line)
			if !slices.Contains(f, "name=stagedrain") || !(slices.Contains(f, "cmd=evalsha") || slices.Contains(f, "cmd=eval")) ||
				!slices.ContainsFunc(f, func(s string) bool { return strings.HasPrefix(s, "flags=") && strings.Contains(s, "b") }) {
				continue
			}
			if slices.ContainsFunc(f, func(s string) bool {
				n, err := strconv.Atoi(strings.TrimPrefix(s, "argv-mem="))
				return strings.HasPrefix(s, "argv-mem=") && err == nil && n > 1000
			}) {
				return true, false
			}
			other = true
		}
		return false, other
	}
	if !pause() {
		return func() {}, false
	}
	tick := time.NewTicker(2 * time.Millisecond)
	defer tick.Stop()
	deadline := time.Now().Add(chaosAimWait)
	for {
		push, other := held()
		if push {
			break
		}
		if other {
			unpause()
			if !pause() {
				return func() {}, false
			}
		}
		if time.Now().After(deadline) {
			unpause()
			c.note("aim: no push came within %s of CLIENT PAUSE WRITE; not aimed", chaosAimWait)
			return func() {}, false
		}
		select {
		case <-tick.C:
		case <-c.ctx.Done():
			return func() {}, false
		}
	}
	c.note("aim: a push script held in Redis (CLIENT PAUSE WRITE)")
	return func() {
		unpause()
		c.note("aim: CLIENT UNPAUSE")
	}, true
}

// chaosAimWait is how long aimAtPush waits for a push to come.
const chaosAimWait = time.Second

func (c *chaos) restartPostgres() {
	c.t.Helper()
	c.outage(c.pg.Stop, "PostgreSQL stopped", c.plan.pgDownFor, c.pg.Start, "PostgreSQL started")
}

func (c *chaos) killRedis() {
	c.t.Helper()
	c.outage(c.redis.Stop, "Redis killed", c.plan.redisDownFor, c.redis.Start, "Redis started")
}

// stallRedis freezes Redis with SIGSTOP for redisStallFor, longer than
// the relays' read timeout, and thaws it: what a client sent meanwhile
// (and what it sent again after a timeout) runs once it thaws.
func (c *chaos) stallRedis() {
	c.t.Helper()
	c.outage(func() { c.redis.Signal(syscall.SIGSTOP) }, "SIGSTOP Redis", c.plan.redisStallFor,
		func() { c.redis.Signal(syscall.SIGCONT) }, "SIGCONT Redis")
}

// outage runs stop, notes stopped, waits d, runs start and notes started.
func (c *chaos) outage(stop func(), stopped string, d time.Duration, start func(), started string) {
	c.t.Helper()
	stop()
	c.note("%s", stopped)
	c.pause(d)
	start()
	c.note("%s", started)
}

// plantPoison commits a transaction with two rows the relay must
// dead-letter (a payload over --max-payload-bytes; a job for a queue whose
// key holds a string) between ordinary jobs.
func (c *chaos) plantPoison() {
	c.t.Helper()
	n := c.faults["poison"] // this one counted already
	tx := &chaosTx{id: fmt.Sprintf("poison.%d", n), commit: true, schema: c.schemas[0]}
	if c.fleet {
		tx.schema = c.schemas[c.rng.IntN(len(c.schemas))]
	}
	tx.add("default", false, "")
	tx.add("default", false, "oversize")
	tx.add("critical", false, "")
	tx.add(chaosWrongTypeQueue, false, "wrongtype")
	tx.add("mailers", false, "")
	err := c.sql[tx.schema].run(c.ctx, c.db(), tx)
	c.note("planted %s in %s: %s (%v)", tx.id, tx.schema, tx.outcome, err)
	c.txs = append(c.txs, tx)
}
