package bench

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
)

// The app-cost scenario: what the trigger costs the app's writes in each
// state a relay may be in (issue 23). The trigger notifies only while a
// relay holds its schema's idle lock, idle and listening
// (sql/010_wake_when_idle.sql), and every notifying commit takes
// PostgreSQL's notify lock, which serializes them database-wide. So the
// app should pay nothing when no relay is idle: none running, one polling,
// one whose Redis hangs; and little beside a relay, where one commit of
// a schema notifies at a time (sql/012_wake_one_notifier.sql). A fleet's
// tenants each see a trickle: each is idle between its commits, until
// the fleet runs hot.

// The two sides of a state run at the same time, not one after the
// other: half the writers stage in the state's tables, triggers enabled,
// and half in twin tables of their own (another schema, or as many other
// schemas for a fleet) whose triggers are disabled, beside a twin relay
// of the same kind when the state's relay drains. Run one after the
// other, the two sides measured mostly the disk: on this project's 2-core
// machine, pgbench's one-row INSERTs with the trigger disabled both times
// read 3,448 and 6,776 TPS in one sitting, 15 s apart, so a 5% target
// could not be told from chance. At the same time both sides share every
// WAL flush, and the same comparison reads within 0.5% (A/A), with the
// trigger of a schema no relay runs at 98-100%. The relays' CPU falls on
// both sides alike; it is counted apart, per 1,000 jobs.

// appCostRounds is how many runs each state has, the two sides together.
const appCostRounds = 2

// appCostWriters is the writers of each side: half of --writers.
func (b *bench) appCostWriters() int { return max(1, b.cfg.Writers/2) }

// appSide is one side of a state: the tables its writers stage in, the
// queue of their jobs, and what its relay is started on.
type appSide struct {
	tables     []string // quoted
	queue      string   // "": the column's default ("default")
	schemaArgs []string // the relay's --schema or --schemas and its value
	// prefix is what the names of a fleet's schemas start with.
	prefix string
}

// appCostCase is one state of the app-cost scenario.
type appCostCase struct {
	label  string
	target float64 // the least TPS with the triggers, as a share of without; 0: none
	// side and twin: the state's tables and the twin tables.
	side, twin appSide
	// start starts the state's relay on a side and waits until it is in
	// the state (with the side's triggers enabled); nil: no relay.
	start func(ctx context.Context, s appSide, twin bool) (*relayProc, error)
	// drains: the relay delivers what the runs stage; each run waits for
	// it, and the relay's CPU is counted per job. A twin relay runs only
	// for such a state: the twin of a relay that drains nothing (Redis
	// hung) is no relay.
	drains bool
	// check, if set, is called before each run and says how the state
	// failed what its target is about ("" if it did not).
	check func(ctx context.Context) (string, error)
	// after, if set, runs with the state's relay before it stops, the
	// triggers enabled, and returns rows of its own.
	after func(ctx context.Context, p *relayProc) ([]benchRow, error)
	note  string
}

// appCostSide is what the runs of one side (triggers enabled, or the
// twin's disabled) of a state measured, summed over the rounds.
type appCostSide struct {
	tps       float64 // the mean over the rounds
	delivered int64
	cpu       time.Duration
}

// cpuPer1000 is the relay's CPU per 1,000 jobs delivered, in ms.
func (s appCostSide) cpuPer1000() float64 {
	return float64(s.cpu) / float64(time.Millisecond) * 1000 / float64(s.delivered)
}

// benchAppCost measures the app's write TPS in each state against twin
// tables with their triggers disabled, at the same time, in runs of
// --duration, and the relay's CPU per 1,000 jobs delivered.
func (b *bench) benchAppCost(ctx context.Context) error {
	conn, err := b.connect(ctx)
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	// The twin of the scratch schema: a tenant schema, so that cleanup
	// drops it; no fleet's pattern (group "a", "b") matches its name.
	twinSchema := b.tenantSchemas("twin", 1)[0]
	if err := b.migrateTenants(ctx, []string{twinSchema}); err != nil {
		return err
	}
	one := appSide{tables: []string{b.table()}, schemaArgs: []string{"--schema", b.schema}}
	twin := appSide{tables: b.tenantTables([]string{twinSchema}), queue: "bench_twin", schemaArgs: []string{"--schema", twinSchema}}
	polling := "app cost: polling relay"
	if b.pollOnly {
		polling += " (--poll-only)"
	}
	half := b.appCostWriters()
	cases := []appCostCase{
		{label: "app cost: no relay", target: 0.95, side: one, twin: twin,
			note: fmt.Sprintf("%d writers on each side at the same time, one job per transaction: the state's tables with their triggers, and twin tables with their triggers disabled (beside a twin relay where the state's relay drains); %d runs of %s", half, appCostRounds, b.cfg.TPSDuration)},
		{label: polling, side: one, twin: twin, drains: true, note: "a relay of the schema that never holds the idle lock",
			start: func(ctx context.Context, s appSide, twin bool) (*relayProc, error) {
				p, err := b.startSideRelay(true, s, twin)
				if err != nil {
					return nil, err
				}
				return p, b.waitReadyOn(ctx, p, false, s.tables)
			}},
		{label: "app cost: relay and trigger", target: 0.90, side: one, twin: twin, drains: true, note: "a relay of the schema, as users run it",
			start: func(ctx context.Context, s appSide, twin bool) (*relayProc, error) {
				p, err := b.startSideRelay(false, s, twin)
				if err != nil {
					return nil, err
				}
				return p, b.waitReadyOn(ctx, p, true, s.tables)
			}},
		b.hungCase(conn, one, twin),
	}
	run := func(c appCostCase) error {
		row, more, err := b.appCost(ctx, conn, c)
		if err != nil {
			return fmt.Errorf("%s: %w", strings.TrimPrefix(c.label, "app cost: "), err)
		}
		b.rows = append(b.rows, row)
		b.rows = append(b.rows, more...)
		return nil
	}
	for _, c := range cases {
		if err := run(c); err != nil {
			return err
		}
	}
	for _, n := range b.cfg.AppCostSchemas {
		// Ascending sizes, each migrated when its turn comes: the pattern
		// matches exactly the first n. The twins are group "b".
		schemas, twins := b.tenantSchemas("a", n), b.tenantSchemas("b", n)
		if err := b.migrateTenants(ctx, slices.Concat(schemas, twins)); err != nil {
			return err
		}
		tables := b.tenantTables(schemas)
		side := appSide{tables: tables, schemaArgs: []string{"--schemas", b.tenantPattern("a")}, prefix: b.schema + "_a"}
		fleetTwin := appSide{tables: b.tenantTables(twins), queue: "bench_twin", schemaArgs: []string{"--schemas", b.tenantPattern("b")}, prefix: b.schema + "_b"}
		note := fmt.Sprintf("one relay --schemas of %d schemas; each transaction stages its row in one of them at random", n)
		if b.cfg.Quick {
			note += " (--quick: fewer schemas than a full run's 20 and 200)"
		}
		err := run(appCostCase{label: fmt.Sprintf("app cost: relay --schemas, %s schemas", fmtInt(int64(n))),
			target: 0.90, side: side, twin: fleetTwin, drains: true, note: note,
			start: func(ctx context.Context, s appSide, twin bool) (*relayProc, error) {
				var have int
				if err := conn.QueryRow(ctx, "SELECT count(*) FROM pg_namespace WHERE starts_with(nspname, $1)", s.prefix).Scan(&have); err != nil {
					return nil, fmt.Errorf("count the schemas: %w", err)
				}
				if have != n {
					return nil, fmt.Errorf("%d schemas match --schemas %s*, want %d", have, s.prefix, n)
				}
				p, err := b.startSideRelay(false, s, twin)
				if err != nil {
					return nil, err
				}
				if err := b.probeAll(ctx, p, s.tables); err != nil {
					return nil, err
				}
				return p, b.waitReadyOn(ctx, p, true, s.tables)
			},
			// The latency of a fleet's commits spread over its schemas,
			// against the single-schema targets of the latency scenario.
			after: func(ctx context.Context, p *relayProc) ([]benchRow, error) {
				var rows []benchRow
				for _, rate := range []int{100, 1000} {
					row, err := b.latency(ctx, p, latencyCase{rate: rate, writers: 4,
						p50: time.Millisecond, p99: 5 * time.Millisecond, tables: tables})
					if err != nil {
						return nil, err
					}
					rows = append(rows, row)
				}
				return rows, nil
			}})
		if err != nil {
			return err
		}
	}
	return nil
}

// startSideRelay starts the relay of a side: the state's (startRelayOn)
// or, with twin, the twin relay (startTwin).
func (b *bench) startSideRelay(pollOnly bool, s appSide, twin bool) (*relayProc, error) {
	if twin {
		return b.startTwin(pollOnly, s.schemaArgs...)
	}
	return b.startRelayOn(pollOnly, s.schemaArgs...)
}

// appCost runs one state: its relay and twin relay started (if any), then
// its rounds.
func (b *bench) appCost(ctx context.Context, conn *pgx.Conn, c appCostCase) (benchRow, []benchRow, error) {
	tables := slices.Concat(c.side.tables, c.twin.tables)
	if err := b.resetTables(ctx, conn, tables); err != nil {
		return benchRow{}, nil, err
	}
	// Enabled while the relays start: a relay is ready once its commits
	// wake it.
	if err := setTriggers(ctx, conn, tables, true); err != nil {
		return benchRow{}, nil, err
	}
	var p, tp *relayProc
	if c.start != nil {
		var err error
		if p, err = c.start(ctx, c.side, false); err != nil {
			return benchRow{}, nil, err
		}
		if c.drains {
			if tp, err = c.start(ctx, c.twin, true); err != nil {
				return benchRow{}, nil, err
			}
		}
	}
	if err := setTriggers(ctx, conn, c.twin.tables, false); err != nil {
		return benchRow{}, nil, err
	}
	keys := [2]string{b.queueKey("bench_twin"), b.queueKey("default")}
	procs := [2]*relayProc{tp, p}
	var sides [2]appCostSide // twin (triggers disabled), state (enabled)
	// misses make the row MISS whatever its TPS; unsure make it not
	// judged.
	var misses, unsure []string
	half := b.appCostWriters()
	for round := range appCostRounds {
		// Between runs a side's tables are emptied while no relay runs,
		// and have been by a relay that drains. A relay whose Redis hangs
		// would go idle on an empty table: its rows stay.
		switch {
		case p == nil:
			if err := b.resetTables(ctx, conn, tables); err != nil {
				return benchRow{}, nil, err
			}
		case c.drains:
			// Everything delivered: only the queues to empty.
			if err := b.rdb.Del(ctx, keys[:]...).Err(); err != nil {
				return benchRow{}, nil, fmt.Errorf("DEL %s: %w", strings.Join(keys[:], " "), err)
			}
		default:
			if _, err := conn.Exec(ctx, "TRUNCATE "+strings.Join(c.twin.tables, ", ")); err != nil {
				return benchRow{}, nil, fmt.Errorf("truncate the twin tables: %w", err)
			}
		}
		if c.check != nil {
			miss, err := c.check(ctx)
			if err != nil {
				return benchRow{}, nil, err
			}
			if miss != "" && !slices.Contains(misses, miss) {
				misses = append(misses, miss)
			}
		}
		var cpu0 [2]time.Duration
		for i, pr := range procs {
			if pr == nil {
				continue
			}
			var err error
			if cpu0[i], err = pr.cpu(); err != nil {
				return benchRow{}, nil, err
			}
		}
		label := fmt.Sprintf("%s, run %d (group 1: twin, triggers disabled; group 2: triggers enabled)", c.label, round+1)
		tps, commits, err := b.appTPSGroups(ctx, label, b.cfg.TPSDuration,
			writerGroup{tables: c.twin.tables, queue: c.twin.queue, writers: half},
			writerGroup{tables: c.side.tables, queue: c.side.queue, writers: half})
		if err != nil {
			return benchRow{}, nil, err
		}
		for i, pr := range procs {
			side := &sides[i]
			side.tps += tps[i] / appCostRounds
			if pr == nil {
				continue
			}
			if err := pr.exited(); err != nil {
				return benchRow{}, nil, err
			}
			if c.drains {
				n, err := b.waitDelivered(ctx, pr, keys[i], commits[i])
				if err != nil {
					return benchRow{}, nil, err
				}
				if n < commits[i] {
					unsure = append(unsure, fmt.Sprintf("%s of %s committed jobs delivered within %s", fmtInt(n), fmtInt(commits[i]), deliveredTimeout))
				}
				side.delivered += n
			}
			cpu1, err := pr.cpu()
			if err != nil {
				return benchRow{}, nil, err
			}
			side.cpu += cpu1 - cpu0[i]
		}
	}
	if tp != nil {
		if _, err := b.stopTwin(); err != nil {
			return benchRow{}, nil, err
		}
	}
	if b.hungRedis != nil {
		// First: the relay's hung reads then end at once, and so does it.
		b.hungRedis.close()
		b.hungRedis = nil
	}
	var more []benchRow
	if p != nil && c.after != nil {
		var err error
		if more, err = c.after(ctx, p); err != nil {
			return benchRow{}, nil, err
		}
	}
	if p != nil {
		if _, err := b.stopRelay(); err != nil {
			return benchRow{}, nil, err
		}
	}

	off, on := sides[0], sides[1]
	ratio := on.tps / off.tps
	b.progress("%s: %.0f TPS, %.0f%% of %.0f with the triggers disabled", c.label, on.tps, 100*ratio, off.tps)
	row := benchRow{scenario: c.label, offered: "closed loop", achieved: fmtRate(on.tps),
		note: fmt.Sprintf("%.0f%% of %s with the triggers disabled; %s", 100*ratio, fmtRate(off.tps), c.note)}
	if c.target > 0 {
		row.target = fmt.Sprintf(">= %.0f%% of triggers disabled", 100*c.target)
		row.result = b.verdict(ratio >= c.target)
	}
	switch {
	case p == nil:
	case c.drains && on.delivered > 0 && off.delivered > 0:
		row.note += fmt.Sprintf("; relay CPU %.1f ms per 1,000 jobs (%.1f with the triggers disabled)", on.cpuPer1000(), off.cpuPer1000())
	case c.drains:
		row.note += "; relay CPU: no job delivered"
	default:
		row.note += fmt.Sprintf("; relay CPU %s over the runs, no job delivered", on.cpu.Round(time.Millisecond))
	}
	if all := slices.Concat(misses, unsure); len(all) > 0 {
		row.note += "; " + strings.Join(all, "; ")
	}
	switch {
	case row.result == "" || b.cfg.Quick:
	case len(misses) > 0:
		row.result = "MISS"
	case len(unsure) > 0:
		row.result = "not judged (" + unsure[0] + ")"
	}
	return row, more, nil
}

// deliveredTimeout bounds the wait for a run's jobs to reach Redis.
const deliveredTimeout = time.Minute

// waitDelivered waits until the relay has delivered want jobs to key, or
// deliveredTimeout has passed, and returns how many it has.
func (b *bench) waitDelivered(ctx context.Context, p *relayProc, key string, want int64) (int64, error) {
	deadline := time.Now().Add(deliveredTimeout)
	for {
		n, err := b.rdb.LLen(ctx, key).Result()
		if err != nil {
			return 0, fmt.Errorf("LLEN %s: %w", key, err)
		}
		if n >= want || time.Now().After(deadline) {
			return n, nil
		}
		if err := p.exited(); err != nil {
			return 0, err
		}
		if err := sleepCtx(ctx, 10*time.Millisecond); err != nil {
			return 0, err
		}
	}
}

// hungCase is the state of a relay whose Redis hangs: it leads the scratch
// schema and tried to push the job that woke it, and that push (and every
// command after) gets no answer. The runs leave the rows staged: the relay
// retries them, awake, after each timeout.
func (b *bench) hungCase(conn *pgx.Conn, side, twin appSide) appCostCase {
	return appCostCase{label: "app cost: relay, Redis hung", target: 0.95, side: side, twin: twin,
		note: "a relay of the schema whose Redis (a listener in the bench) answered its start and hangs since its first push; no twin relay",
		start: func(ctx context.Context, _ appSide, _ bool) (*relayProc, error) {
			h, err := startHungRedis()
			if err != nil {
				return nil, err
			}
			b.hungRedis = h
			p, err := b.startRelayWith(h.url(), false, "--schema", b.schema)
			if err != nil {
				return nil, err
			}
			if err := waitUntil(ctx, 60*time.Second, "the relay idle and listening (holding its idle lock)", func() (bool, error) {
				held, err := b.idleLockHeld(ctx, conn, b.schema)
				return held, errors.Join(err, p.exited())
			}); err != nil {
				return nil, err
			}
			// A commit wakes it; its push hangs.
			if _, err := conn.Exec(ctx, "INSERT INTO "+b.table()+" (job_name, job_args) VALUES ('BenchProbeJob', '[]')"); err != nil {
				return nil, fmt.Errorf("stage a probe job: %w", err)
			}
			if err := waitUntil(ctx, 60*time.Second, "the relay's first push", func() (bool, error) {
				return h.hung.Load(), p.exited()
			}); err != nil {
				return nil, err
			}
			// Marked awake 100ms into the hung push (relay/wake.go,
			// slowPush). If it is not, the runs measure it all the same,
			// and check says so.
			err = waitUntil(ctx, 30*time.Second, "the relay awake (its idle lock released)", func() (bool, error) {
				held, err := b.idleLockHeld(ctx, conn, b.schema)
				return !held, errors.Join(err, p.exited())
			})
			if err != nil && !errors.Is(err, errWaited) {
				return nil, err
			}
			return p, nil
		},
		check: func(ctx context.Context) (string, error) {
			held, err := b.idleLockHeld(ctx, conn, b.schema)
			if err != nil || !held {
				return "", err
			}
			return "the relay held its idle lock (commits notified it) at the start of a run", nil
		}}
}

// errWaited is waitUntil's error when its timeout passed.
var errWaited = errors.New("waited")

// waitUntil calls cond every 20ms until it reports true or an error, or
// timeout passes (then the error is errWaited).
func waitUntil(ctx context.Context, timeout time.Duration, what string, cond func() (bool, error)) error {
	deadline := time.Now().Add(timeout)
	for {
		ok, err := cond()
		if err != nil || ok {
			return err
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%w %s for %s", errWaited, timeout, what)
		}
		if err := sleepCtx(ctx, 20*time.Millisecond); err != nil {
			return err
		}
	}
}

// idleLockHeld reports whether a session holds schema's idle lock, as its
// relay does while idle and listening, so that commits notify: the
// advisory lock hashtext('stagedrain-idle:' || schema) of
// sql/010_wake_when_idle.sql, in 16 shards, taken exclusively.
func (b *bench) idleLockHeld(ctx context.Context, conn *pgx.Conn, schema string) (bool, error) {
	var held bool
	err := conn.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_locks
		WHERE locktype = 'advisory' AND objsubid = 2 AND mode = 'ExclusiveLock' AND granted
		  AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
		  AND classid::bigint = (hashtext($1)::bigint + 4294967296) % 4294967296)`,
		"stagedrain-idle:"+schema).Scan(&held)
	if err != nil {
		return false, fmt.Errorf("read pg_locks: %w", err)
	}
	return held, nil
}

// hungRedis is a Redis that hangs, as one stopped (SIGSTOP) after the
// relay started: it answers a client's handshake (HELLO refused, so that
// go-redis falls back to RESP2; CLIENT, SELECT, PING, INFO) until the
// first other command, a push, and from then on answers nothing, on any
// connection, while it accepts and reads them all. A client's reads time
// out.
type hungRedis struct {
	ln   net.Listener
	hung atomic.Bool // a command other than the handshake's came
	wg   sync.WaitGroup

	mu    sync.Mutex
	conns map[net.Conn]struct{} // nil once closed
}

// startHungRedis listens on a port of 127.0.0.1 and serves.
func startHungRedis() (*hungRedis, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("listen for the hung Redis: %w", err)
	}
	h := &hungRedis{ln: ln, conns: make(map[net.Conn]struct{})}
	h.wg.Add(1)
	go h.accept()
	return h, nil
}

func (h *hungRedis) url() string { return "redis://" + h.ln.Addr().String() + "/0" }

func (h *hungRedis) accept() {
	defer h.wg.Done()
	for {
		c, err := h.ln.Accept()
		if err != nil {
			return // closed
		}
		h.mu.Lock()
		if h.conns == nil {
			h.mu.Unlock()
			_ = c.Close()
			return
		}
		h.conns[c] = struct{}{}
		h.wg.Add(1)
		h.mu.Unlock()
		go h.serve(c)
	}
}

func (h *hungRedis) serve(c net.Conn) {
	defer h.wg.Done()
	defer func() {
		h.mu.Lock()
		if h.conns != nil {
			delete(h.conns, c)
		}
		h.mu.Unlock()
		_ = c.Close()
	}()
	r := bufio.NewReader(c)
	for {
		args, err := readCommand(r)
		if err != nil {
			return
		}
		if h.hung.Load() {
			continue
		}
		reply, ok := handshakeReply(args)
		if !ok {
			h.hung.Store(true)
			continue
		}
		if _, err := io.WriteString(c, reply); err != nil {
			return
		}
	}
}

// close stops listening, closes every connection and waits for their
// goroutines.
func (h *hungRedis) close() {
	_ = h.ln.Close()
	h.mu.Lock()
	for c := range h.conns {
		_ = c.Close()
	}
	h.conns = nil
	h.mu.Unlock()
	h.wg.Wait()
}

// handshakeReply is the reply to a command of a client's start, and false
// for any other command.
func handshakeReply(args []string) (string, bool) {
	if len(args) == 0 {
		return "", false
	}
	switch strings.ToUpper(args[0]) {
	case "HELLO":
		return "-ERR unknown command 'HELLO'\r\n", true
	case "CLIENT", "SELECT":
		return "+OK\r\n", true
	case "PING":
		return "+PONG\r\n", true
	case "INFO":
		const info = "# stagedrain bench: a Redis that hangs\r\n"
		return "$" + strconv.Itoa(len(info)) + "\r\n" + info + "\r\n", true
	}
	return "", false
}

// readCommand reads one command a client sent: a RESP array of bulk
// strings, or an inline command.
func readCommand(r *bufio.Reader) ([]string, error) {
	line, err := r.ReadString('\n')
	if err != nil {
		return nil, err
	}
	line = strings.TrimRight(line, "\r\n")
	if !strings.HasPrefix(line, "*") {
		return strings.Fields(line), nil
	}
	n, err := strconv.Atoi(line[1:])
	if err != nil || n < 0 || n > 1<<20 {
		return nil, fmt.Errorf("bad array header %q", line)
	}
	args := make([]string, 0, n)
	for range n {
		hdr, err := r.ReadString('\n')
		if err != nil {
			return nil, err
		}
		hdr = strings.TrimRight(hdr, "\r\n")
		size, err := strconv.Atoi(strings.TrimPrefix(hdr, "$"))
		if !strings.HasPrefix(hdr, "$") || err != nil || size < 0 || size > 1<<26 {
			return nil, fmt.Errorf("bad bulk header %q", hdr)
		}
		buf := make([]byte, size+2)
		if _, err := io.ReadFull(r, buf); err != nil {
			return nil, err
		}
		args = append(args, string(buf[:size]))
	}
	return args, nil
}
