package relay

import (
	"context"
	"maps"
	"math"
	"slices"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// SetAfterPush makes r run f between each batch's push and its delete; an
// error from f fails the batch there, as a crash at that point would.
func SetAfterPush(r *Relay, f func(ctx context.Context) error) { r.hooks.afterPush = f }

// SetBeforePush makes r run f before each batch's push.
func SetBeforePush(r *Relay, f func(ctx context.Context)) { r.hooks.beforePush = f }

// SetOnClaim makes r call f after each claim of its own drain, with the
// number of rows the claim took.
func SetOnClaim(r *Relay, f func(jobs int)) { r.hooks.claimed = f }

// SetOnTidy makes r call f after each tidy of its handoff record: atEnd
// at a drain's end, else by its drain loop's timer.
func SetOnTidy(r *Relay, f func(atEnd bool)) { r.hooks.tidied = f }

// SetOnMarkConfirm sets a function called when the drain loop claims from
// the low-water mark after a shared drain (drainLoop's confirm); on a
// fleet's Relay, before Run, for every schema it finds.
func SetOnMarkConfirm(r *Relay, f func()) { r.hooks.markConfirm = f }

// SetOnIdle makes r call f each time its drain loop goes idle, with the
// number of LISTENs completed before its last drain began.
func SetOnIdle(r *Relay, f func(listens int64)) { r.hooks.idle = f }

// IdleLockName is the gate's advisory lock name (held while the relay is idle).
var IdleLockName = idleLockName

// HoldGateLocks takes on conn the locks an idle relay of schema holds
// (of queues, or of all queues when there are none), with the relay's own
// statement: as if such a relay were idle, until ReleaseGateLocks.
func HoldGateLocks(ctx context.Context, conn *pgx.Conn, schema string, queues ...string) error {
	_, err := conn.Exec(ctx, gateLockSQL, gateLockNames(schema, queues).args()...)
	return err
}

// ReleaseGateLocks gives back what HoldGateLocks took.
func ReleaseGateLocks(ctx context.Context, conn *pgx.Conn, schema string, queues ...string) error {
	_, err := conn.Exec(ctx, gateUnlockSQL, gateLockNames(schema, queues).args()...)
	return err
}

// SetSummaryEvery sets how often r logs its summary line (default 10s).
func SetSummaryEvery(r *Relay, d time.Duration) { r.summaryEvery = d }

// HandoffKeys returns the fence and record keys of a schema, or of one
// group of queues in it (Config.Queues sorted and comma-joined).
func HandoffKeys(namespace, database, schema string, group ...string) (fence, record string) {
	g := ""
	if len(group) > 0 {
		g = group[0]
	}
	k := newHandoffKeys(namespace, database, schema, g)
	return k.Fence, k.Record
}

// SetBacklogTTL sets how long a scrape of r's metrics reuses the leader's
// backlog sample (default 5s); 0 samples on every scrape.
func SetBacklogTTL(r *Relay, d time.Duration) { r.backlog.ttl = d }

// SetDrainIdleInTx sets the drain sessions' idle_in_transaction_session_timeout
// (default 30s).
func SetDrainIdleInTx(r *Relay, d time.Duration) { r.drainIdleInTx = d }

// SetListenerHeartbeat sets how long r's listener may hear nothing before
// the relay sends it a heartbeat (default 30s).
func SetListenerHeartbeat(r *Relay, d time.Duration) { r.listenerHeartbeat = d }

// SetOnListenerConnected makes r call f with its listener's backend pid
// each time the listener has connected, before its LISTEN.
func SetOnListenerConnected(r *Relay, f func(pid uint32)) { r.hooks.listenerConnected = f }

// ListenerConnConfig is the connection config of r's listener.
func ListenerConnConfig(r *Relay) *pgx.ConnConfig { return r.listenerConnConfig() }

// ConnConfig is the connection config r uses for role ("leader",
// "listener", "drain"), before what each adds of its own.
func ConnConfig(r *Relay, role string) *pgx.ConnConfig { return r.connConfig(role) }

// ReadmeGrants returns the GRANTs of the README's "Least-privilege role"
// block, for schema and role.
func ReadmeGrants(t testing.TB, schema, role string) []string { return readmeGrants(t, schema, role) }

// StoppedOnBackpressure reports whether r's last drain ended on a
// backpressure stop (Redis nearly full, or maxPausedBatches batches in a
// row held back whole). Only from r's idle hook (SetOnIdle), which runs
// on the drain goroutine, the one that owns what it reads.
func StoppedOnBackpressure(r *Relay) bool { return r.bp.stop() }

// ExpireMemoryCheck makes r's next check of RedisMaxMemoryRatio read INFO
// memory, however recent the last read. Only from a hook that runs on r's
// drain goroutine (SetOnIdle, SetBeforePush, SetAfterPush), which owns it.
func ExpireMemoryCheck(r *Relay) { r.bp.memChecked = time.Time{} }

// FleetHot reports whether the fleet r runs hot (fleethot.go).
func FleetHot(r *Relay) bool { return r.fleet != nil && r.fleet.hot.Load() }

// FleetHotEnter is the rate of commits (a second) from which a fleet whose
// role sees no waits runs hot (fleethot.go).
const FleetHotEnter = hotEnter

// SetOnStandbyBehind sets a hook run each time a batch, before its push,
// finds that the standbys have not flushed its commits (standby.go).
func SetOnStandbyBehind(r *Relay, f func(lsn uint64)) { r.hooks.standbyBehind = f }

// SetFleetHotLeave sets the rate of schemas found with rows (a second)
// below which a hot fleet r cools: a test that needs the fleet to stay hot
// while it checks sets it low, so that a busy machine's slow commits do
// not cool it (fleethot.go). Before Run.
func SetFleetHotLeave(r *Relay, perSec float64) { r.fleet.hotLeave = perSec }

// SetFleetHotEnter sets the rate of commits (a second) at which r's fleet
// runs hot, waits or not: a test that needs each schema's own drain sets it
// out of reach.
func SetFleetHotEnter(r *Relay, perSec float64) {
	r.fleet.hotEnter, r.fleet.hotWaitFrom, r.fleet.hotAlways = perSec, perSec, perSec
}

// SetFleetHotOnRate makes r's fleet run hot on the rate of its commits
// alone, from hotEnter a second, whether or not they wait for the notify
// lock, and never try cool while they come: a test that makes the fleet
// hot with a busy app's commits, whose waits depend on the machine
// (fleethot.go). Before Run.
func SetFleetHotOnRate(r *Relay) {
	r.fleet.hotWaitFrom, r.fleet.hotAlways, r.fleet.hotProbe = r.fleet.hotEnter, r.fleet.hotEnter, time.Hour
}

// SetFleetHotOnWaits makes r's fleet run hot from perSec commits a second
// only while sessions wait for a lock on an object, never on the rate
// alone; tryAfter is how long after it went hot it first tries cool
// (hotProbe). Before Run.
func SetFleetHotOnWaits(r *Relay, perSec float64, tryAfter time.Duration) {
	r.fleet.hotEnter, r.fleet.hotWaitFrom, r.fleet.hotAlways, r.fleet.hotProbe = perSec, perSec, math.Inf(1), tryAfter
}

// LowWater returns the relay's low-water mark (lowwater.go), and false
// when it has none (off, or not leading yet).
func LowWater(r *Relay) (int64, bool) {
	w := r.mark.Load()
	return w.get(), w != nil
}

// LastClaimFrom returns the id above which the relay's last claim from the
// low-water mark started.
func LastClaimFrom(r *Relay) int64 {
	if w := r.mark.Load(); w != nil {
		return w.lastFrom.Load()
	}
	return fromStart
}

// ClaimMarkSQL is the relay's claim statement with the mark's reads.
func ClaimMarkSQL(r *Relay) string { return r.sql.claimMark }

// ProbeSQL is r's probe below the low-water mark: $1 the mark, the last
// argument the id it looks above (lowwater.go).
func ProbeSQL(r *Relay) string { return r.sql.probe }

// FullProbeDue is fullProbeDue.
var FullProbeDue = fullProbeDue

// SetProbeEvery sets how often the probe below the low-water mark runs.
func SetProbeEvery(r *Relay, d time.Duration) { r.hooks.probeEvery = d }

// SetOnProbeTurn sets a function run at each turn of the probe below the
// low-water mark, with the schema and the time since its turn before (or
// since the probe began). A fleet's schemas get it, and SetProbeEvery's
// interval, when they are found.
func SetOnProbeTurn(r *Relay, f func(schema string, since time.Duration)) { r.hooks.probeTurn = f }

// SetOnProbeFound sets a function called with each id the probe finds.
func SetOnProbeFound(r *Relay, f func(id int64)) { r.hooks.probeFound = f }

// BacklogQuery returns the statement and arguments of the relay's next
// backlog sample (the summary line's and the backlog gauges'), and whether
// it runs with sequential scans off.
func BacklogQuery(r *Relay) (string, []any, bool) { return r.backlog.query() }

// FleetTenant returns the relay of the fleet r's schema, nil if it has none.
func FleetTenant(r *Relay, schema string) *Relay {
	r.fleet.mu.Lock()
	defer r.fleet.mu.Unlock()
	if t := r.fleet.tenants[schema]; t != nil {
		return t.r
	}
	return nil
}

// FleetPollQuery returns the fleet r's poll over its first 16 schemas
// (pollChunk), from their low-water marks, and its arguments.
func FleetPollQuery(r *Relay) (string, []any) {
	f := r.fleet
	f.mu.Lock()
	var led []*tenant
	for _, name := range slices.Sorted(maps.Keys(f.tenants)) {
		led = append(led, f.tenants[name])
	}
	f.mu.Unlock()
	return pollSQL(led, f.table, false)[0], pollArgs(led, r.cfg.Queues, false)[0]
}

// NextDueLookSQL is the relay's statement after each drain of a target
// with no scheduler: the next run_at, and the look below the mark for rows
// that came due ($1 the mark, $2 since when).
func NextDueLookSQL(r *Relay) string { return r.sql.nextDueLook }
