// Package target holds what the relay knows of each job system it writes
// for: a file per target, each registering the target's Spec. The relay's
// config validation, the backpressure length check, the trace placement
// and the claim (due-only or not) read the Spec instead of switching on the
// target's name.
//
// A target's Builder turns claimed rows (Job) into the ops of a batch's
// handoff.Unit; the relay runs them in its atomic push step
// (relay/internal/handoff), with the fence and the record, so every target
// gets the same guarantees. A target that needs a kind of op the handoff
// does not have (a Lua op, as BullMQ's add) adds it to the handoff's API.
package target

import (
	"cmp"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/stagedrain/stagedrain/relay/internal/handoff"
)

// Spec is what a target declares of itself.
type Spec struct {
	// Name is the target's Config.Target (--target).
	Name string
	// Order places the target in lists (errors, help): the built-in ones
	// 1 to 5, a new one the next number.
	Order int
	// Help is the job system, as --target's help names it.
	Help string
	// DueOnly says that the job system has no schedule the relay can
	// write to: the relay claims a job only once its run_at is due, and
	// wakes for the next one.
	DueOnly bool
	// NoCluster, when not empty, is why the target cannot run on Redis
	// Cluster (its keys have no hash tags, or its workers cannot read a
	// cluster).
	NoCluster string
	// FixedKeys says that the job system's key names are fixed: no
	// Config.RedisNamespace applies, and one is refused (the reason).
	FixedKeys string
	// Timestamps says that the target takes Config.TimestampFormat;
	// StreamMaxLen that it takes Config.StreamMaxLen.
	Timestamps, StreamMaxLen bool
	// Length is what its ops' length guards measure, for backpressure
	// (handoff.Unit.Limit): LLEN, ZCARD, a sum, or XUNACKED, which needs
	// Redis 7.0's consumer group lag. The Builder's Limit calls use the
	// same constant, stated once in the target's file.
	Length string
	// OwnedKeys are the keys the target's format gives a meaning of its
	// own (the options it maps, the fields or headers it writes):
	// Config.TenantKey may not be one of them.
	OwnedKeys []string
	// TraceSystem is the messaging.system of its batches' spans.
	TraceSystem string
	// Goldens are its golden files, in testdata/ at the top of the module.
	Goldens []string
	// New makes the target's Builder. Every target has one.
	New func(Options) Builder
}

// Options are the Config fields a Builder is made with.
type Options struct {
	Namespace    string // Config.RedisNamespace
	MaxPayload   int    // Config.MaxPayloadBytes
	Cluster      bool   // Config.Redis is a Redis Cluster client
	Millis       bool   // Config.TimestampFormat is millis (a Spec with Timestamps)
	StreamMaxLen int64  // Config.StreamMaxLen (a Spec with StreamMaxLen)
	Tenant       Tenant // Config.TenantKey and the relay's schema; zero: none
	// UUIDs returns n random UUIDs (the celery target's delivery tags);
	// nil: crypto/rand's. Golden tests fix them.
	UUIDs func(n int) []string
}

// Job is a claimed row of staged_jobs, as the relay hands it to a Builder:
// the relay has refused rows no worker of any target could run (NULL
// columns, a row its source found poison), and Args is trimmed.
type Job struct {
	ID        int64
	Name      string
	Args      []byte // JSON text of an array
	Queue     string
	RunAt     *time.Time
	JID       string
	CreatedAt time.Time
	Options   []byte // JSON text of an object
}

// Rejected is a row no worker could run, and why.
type Rejected struct {
	ID     int64
	Reason string
}

// Result is what a Builder reports of a batch besides its ops.
type Result struct {
	Rejected  []Rejected // not pushed: poison
	Queues    []string   // the queues of the immediate jobs, for the log
	Scheduled int        // how many jobs were scheduled, for the log
}

// A Builder builds batches into units. It is used by one goroutine at a
// time, and may reuse its buffers from batch to batch.
type Builder interface {
	// Add builds batch into u, one op per group of rows that succeed or
	// fail together (handoff.Unit.Begin), and adds rows no worker could
	// run to res. now is the enqueue time.
	Add(u *handoff.Unit, batch []Job, now time.Time, res *Result)
}

var (
	mu    sync.Mutex
	specs = map[string]Spec{}
)

// Register adds a target. A file of this package calls it from init.
func Register(s Spec) {
	mu.Lock()
	defer mu.Unlock()
	if _, ok := specs[s.Name]; ok || s.Name == "" || s.New == nil {
		panic(fmt.Sprintf("target: %q registered twice, without a name or without New", s.Name))
	}
	specs[s.Name] = s
}

// Lookup returns the target named name.
func Lookup(name string) (Spec, bool) {
	mu.Lock()
	defer mu.Unlock()
	s, ok := specs[name]
	return s, ok
}

// Names are the targets' names, in their Order.
func Names() []string {
	mu.Lock()
	all := make([]Spec, 0, len(specs))
	for _, s := range specs {
		all = append(all, s)
	}
	mu.Unlock()
	slices.SortFunc(all, func(a, b Spec) int { return cmp.Or(cmp.Compare(a.Order, b.Order), strings.Compare(a.Name, b.Name)) })
	names := make([]string, len(all))
	for i, s := range all {
		names[i] = s.Name
	}
	return names
}

// OneOf lists the targets' names quoted, for an error: "a", "b" or "c".
func OneOf() string {
	names := Names()
	q := make([]string, len(names))
	for i, n := range names {
		q[i] = fmt.Sprintf("%q", n)
	}
	if len(q) < 2 {
		return strings.Join(q, "")
	}
	return strings.Join(q[:len(q)-1], ", ") + " or " + q[len(q)-1]
}
