package relay

import (
	"time"

	"github.com/stagedrain/stagedrain/relay/internal/handoff"
	targets "github.com/stagedrain/stagedrain/relay/internal/target"
)

// spec is what target t declares of itself (relay/internal/target): the
// zero Spec for a name no target has (Validate refuses it).
func (t Target) spec() targets.Spec {
	s, _ := targets.Lookup(string(t))
	return s
}

// known reports whether t names a target.
func (t Target) known() bool {
	_, ok := targets.Lookup(string(t))
	return ok
}

// targetNames lists the targets' names quoted, for an error.
func targetNames() string { return targets.OneOf() }

// newTarget makes cfg.Target's builder (its Spec's New), writing tenant
// into every job.
func newTarget(cfg Config, tenant tenantTag) target {
	return newSpecTarget(cfg.Target.spec(), targets.Options{Namespace: cfg.RedisNamespace, MaxPayload: cfg.MaxPayloadBytes,
		Cluster: isCluster(cfg.Redis), Millis: cfg.TimestampFormat == TimestampMillis, StreamMaxLen: cfg.StreamMaxLen, Tenant: tenant})
}

func newSpecTarget(s targets.Spec, o targets.Options) *specTarget {
	return &specTarget{b: s.New(o)}
}

// specTarget runs a target's Builder (relay/internal/target). Rows no
// worker of any target could run (checkJob) never reach it.
type specTarget struct {
	b    targets.Builder
	jobs []targets.Job
	res  targets.Result
}

func (s *specTarget) add(u *handoff.Unit, batch []stagedJob, now time.Time, res *pushResult) {
	s.jobs = s.jobs[:0]
	for i := range batch {
		j := &batch[i]
		args, err := checkJob(j)
		if err != nil {
			res.rejected = append(res.rejected, rejectedJob{id: j.id, reason: err.Error()})
			continue
		}
		s.jobs = append(s.jobs, targets.Job{ID: j.id, Name: j.name, Args: args, Queue: j.queue, RunAt: j.runAt,
			JID: j.jid, CreatedAt: j.createdAt, Options: j.options})
	}
	s.res = targets.Result{Rejected: s.res.Rejected[:0], Queues: s.res.Queues[:0]}
	s.b.Add(u, s.jobs, now, &s.res)
	for _, rj := range s.res.Rejected {
		res.rejected = append(res.rejected, rejectedJob{id: rj.ID, reason: rj.Reason})
	}
	res.queues = append(res.queues, s.res.Queues...)
	res.scheduled += s.res.Scheduled
}

// TargetInfo is what a target declares of itself that a command line
// shows: its name, the job system as --target's help names it, and why it
// cannot run on Redis Cluster ("" when it can).
type TargetInfo struct {
	Name      Target
	Help      string
	NoCluster string
}

// Targets lists the targets, in the order Config.Validate's errors name
// them.
func Targets() []TargetInfo {
	var out []TargetInfo
	for _, name := range targets.Names() {
		s, _ := targets.Lookup(name)
		out = append(out, TargetInfo{Name: Target(s.Name), Help: s.Help, NoCluster: s.NoCluster})
	}
	return out
}
