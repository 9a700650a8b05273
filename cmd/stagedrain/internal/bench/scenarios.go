package bench

import (
	"context"
	"strings"
)

// scenario is one group of the table's rows, run by name (--scenarios).
type scenario struct {
	name      string // in --scenarios
	help      string // what --help says of it after its name; "" for nothing
	byDefault bool   // run without --scenarios
	errPrefix string // before its error: "latency: ..."
	// run measures, with relays it starts and stops itself, from an empty
	// staged_jobs and namespace, and appends its rows to b.rows.
	run func(b *bench, ctx context.Context) error
}

// scenarios are bench's scenarios, in the order they run and --help lists
// them. A new one is a file of this package with its method, func (b *bench)
// benchX(ctx context.Context) error, and one line here.
var scenarios = []scenario{
	{name: "tps", byDefault: true, errPrefix: "app TPS", run: (*bench).benchTPS},
	{name: "latency", byDefault: true, errPrefix: "latency", run: (*bench).benchLatency},
	{name: "idle", byDefault: true, errPrefix: "idle", run: (*bench).benchIdle},
	{name: "backlog", byDefault: true, errPrefix: "backlog", run: (*bench).benchBacklog},
	{name: "schemas", byDefault: true, errPrefix: "schemas", run: (*bench).benchSchemas,
		help: "one relay --schemas of 10 schemas: the others' latency while one drains the --backlog"},
	// Not by default: it migrates 1,000 schemas and runs three relays for
	// each of its four sizes.
	{name: "scale", errPrefix: "scale", run: (*bench).benchScale,
		help: "1, 10, 100 and 1,000 schemas: connections, idle statements, RSS, latency; not run by default: several minutes"},
	// Not by default: it runs the writers for --duration 24 times, some
	// beside a relay of 200 schemas.
	{name: "app-cost", errPrefix: "app cost", run: (*bench).benchAppCost,
		help: "the app's write TPS with no relay, a polling relay, a relay, a relay whose Redis hangs, and a relay of 20 and of 200 schemas, each against the same with the triggers disabled, in alternating runs; the relay's CPU per 1,000 jobs; the fleets' latency at 100 and 1,000 jobs/s spread over their schemas; not run by default: several minutes"},
	{name: "fleet-latency", errPrefix: "fleet latency", run: (*bench).benchFleetLatency,
		help: "one relay --schemas of 20 and of 200 schemas, alone: the latency at 100 and 1,000 jobs/s spread over the schemas, after a relay of one schema at the same rates for reference; not run by default"},
	// Not by default: it holds the horizon for --horizon-hold, and the
	// dead rows it leaves are best kept off a server others use.
	{name: "horizon", errPrefix: "horizon", run: (*bench).benchHorizon,
		help: "latency per 10s window while a snapshot holds the xmin horizon back for --horizon-hold, at --horizon-rate; not run by default; run it on a server of its own"},
}

// Scenarios returns the names of the scenarios, in the order they run.
func Scenarios() []string {
	var names []string
	for _, s := range scenarios {
		names = append(names, s.name)
	}
	return names
}

// DefaultScenarios returns the names of those a run without --scenarios
// runs, in order.
func DefaultScenarios() []string {
	var names []string
	for _, s := range scenarios {
		if s.byDefault {
			names = append(names, s.name)
		}
	}
	return names
}

// ScenariosHelp lists the scenarios for --help: each name, and what it
// measures where a name does not say.
func ScenariosHelp() string {
	var parts []string
	for _, s := range scenarios {
		if s.help != "" {
			parts = append(parts, s.name+" ("+s.help+")")
		} else {
			parts = append(parts, s.name)
		}
	}
	return strings.Join(parts, ", ")
}

// scenarioNamed returns the scenario called name, or nil.
func scenarioNamed(name string) *scenario {
	for i := range scenarios {
		if scenarios[i].name == name {
			return &scenarios[i]
		}
	}
	return nil
}
