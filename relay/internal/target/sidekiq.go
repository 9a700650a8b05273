package target

import (
	"bytes"
	"fmt"
	"slices"
	"strconv"
	"time"

	"github.com/stagedrain/stagedrain/relay/internal/handoff"
)

// sidekiqLength is what the sidekiq target's length guards measure: a
// queue's list.
const sidekiqLength = "LLEN"

// Sidekiq: SADD queues, LPUSH queue:<q>, ZADD schedule.
func init() {
	Register(Spec{
		Name:        "sidekiq",
		Order:       1,
		Help:        "sidekiq",
		NoCluster:   "Sidekiq's keys (queue:<name>, queues, schedule) have no hash tags, and Sidekiq does not support Redis Cluster (use a single Redis or Sentinel, or the asynq or streams target)",
		Timestamps:  true,
		Length:      sidekiqLength,
		TraceSystem: "sidekiq",
		// Those the relay writes, and those Sidekiq (6.4 to 8) and its
		// ActiveJob adapter write or read in a job hash.
		OwnedKeys: []string{"class", "args", "queue", "jid", "retry", "created_at", "enqueued_at", "at",
			"wrapped", "retry_count", "retry_queue", "retry_for", "retried_at", "failed_at", "error_message",
			"error_class", "error_backtrace", "backtrace", "dead", "tags", "bid", "log_level", "cattr",
			TraceparentKey, TracestateKey},
		Goldens: []string{"sidekiq_immediate_seconds.json", "sidekiq_immediate_millis.json", "sidekiq_scheduled_seconds.json", "sidekiq_scheduled_millis.json", "sidekiq_tenant.json", "sidekiq_staged_push_rows.json", "sidekiq_staged_push_tenant.json", "article_table.json"},
		New:     func(o Options) Builder { return newSidekiqTarget(o) },
	})
}

// sidekiqKeys builds the keys the Sidekiq target writes.
type sidekiqKeys struct {
	prefix string // "" or "<namespace>:"
}

func newSidekiqKeys(namespace string) sidekiqKeys {
	if namespace == "" {
		return sidekiqKeys{}
	}
	return sidekiqKeys{prefix: namespace + ":"}
}

// queues is the set of queue names Sidekiq's UI and workers know about.
func (k sidekiqKeys) queues() string { return k.prefix + "queues" }

// queue is the list a queue's immediate jobs are LPUSHed to; workers BRPOP it.
func (k sidekiqKeys) queue(name string) string { return k.prefix + "queue:" + name }

// schedule is the sorted set of scheduled jobs, scored by float epoch seconds.
func (k sidekiqKeys) schedule() string { return k.prefix + "schedule" }

// sidekiqTarget writes batches in Sidekiq's layout (sidekiqKeys): an
// immediate job is SADD queues <q> + LPUSH queue:<q> <json>; a job whose
// run_at is in the future is ZADD schedule <epoch seconds> <json>. It only
// builds the commands: the relay runs them, with its fence and record, in
// one atomic step (internal/handoff), one op per queue and one for the schedule,
// so a WRONGTYPE on one queue's key refuses only that queue's jobs.
//
// A sidekiqTarget is used by one goroutine at a time: it reuses its buffers.
type sidekiqTarget struct {
	keys       sidekiqKeys
	millis     bool   // Options.Millis: timestamps in integer epoch ms, else float seconds
	maxPayload int    // bytes; a bigger payload is rejected
	tenant     Tenant // written into every job (relay/tenant.go); zero: none

	buf     []byte         // every payload of the batch, back to back
	queues  []queueGroup   // immediate jobs by queue, queues in order of first use
	queueAt map[string]int // queue name -> index in queues
	sched   scheduleGroup  // scheduled jobs
	names   []any          // the queue names, for SADD queues
}

type scheduleGroup struct {
	ids   []int64
	pairs []any // score, member, score, member, ...
}

func newSidekiqTarget(o Options) *sidekiqTarget {
	return &sidekiqTarget{keys: newSidekiqKeys(o.Namespace), millis: o.Millis, maxPayload: o.MaxPayload, tenant: o.Tenant, queueAt: make(map[string]int)}
}

// add builds batch into u: its payloads, grouped by queue, and the commands
// that push them. now is the enqueue time: a job whose run_at is after now
// is scheduled, any other runs at once. Rows no worker could run are added
// to res.Rejected.
func (s *sidekiqTarget) Add(u *handoff.Unit, batch []Job, now time.Time, res *Result) {
	s.build(batch, now, res)
	if len(s.queues) > 0 {
		// SADD queues only feeds Sidekiq's UI: a job is pushed when its
		// LPUSH is, so this op delivers no row.
		s.names = s.names[:0]
		for _, g := range s.queues {
			s.names = append(s.names, g.name)
		}
		u.Begin(nil, "")
		u.Variadic("SADD", s.keys.queues(), 1, s.names)
	}
	for i := range s.queues {
		g := &s.queues[i]
		u.Begin(g.ids, "")
		u.Limit(g.name, sidekiqLength, s.keys.queue(g.name))
		u.Variadic("LPUSH", s.keys.queue(g.name), 1, g.payloads)
		res.Queues = append(res.Queues, g.name)
	}
	if len(s.sched.ids) > 0 {
		u.Begin(s.sched.ids, "")
		u.Variadic("ZADD", s.keys.schedule(), 2, s.sched.pairs)
		res.Scheduled = len(s.sched.ids)
	}
}

// build resets the target and builds batch's payloads into it, grouped by
// queue (immediate jobs) or into the schedule; rows no worker could run are
// added to res.Rejected. It allocates nothing per job once the target's
// buffers have grown to the batch size, but for boxing each payload (and a
// scheduled job's score) into an argument.
func (s *sidekiqTarget) build(batch []Job, now time.Time, res *Result) {
	s.reset()
	for i := range batch {
		j := &batch[i]
		start := len(s.buf)
		var err error
		s.buf, err = appendSidekiqPayload(s.buf, j, now, s.millis, s.tenant)
		if err != nil {
			s.buf = s.buf[:start]
			res.Rejected = append(res.Rejected, Rejected{ID: j.ID, Reason: err.Error()})
			continue
		}
		if n := len(s.buf) - start; n > s.maxPayload {
			s.buf = s.buf[:start]
			res.Rejected = append(res.Rejected, Rejected{ID: j.ID, Reason: fmt.Sprintf("payload is %d bytes, over the limit of %d (MaxPayloadBytes)", n, s.maxPayload)})
			continue
		}
		// Appending may move buf, but never rewrites bytes already written,
		// so this slice stays valid until the next batch resets buf.
		payload := s.buf[start:len(s.buf):len(s.buf)]
		if j.scheduled(now) {
			s.sched.ids = append(s.sched.ids, j.ID)
			s.sched.pairs = append(s.sched.pairs, epochSeconds(*j.RunAt), payload)
			continue
		}
		g := s.group(j.Queue)
		g.ids = append(g.ids, j.ID)
		g.payloads = append(g.payloads, payload)
	}
}

// group returns the queue group for name, adding it on first use.
func (s *sidekiqTarget) group(name string) *queueGroup {
	i, ok := s.queueAt[name]
	if !ok {
		i = len(s.queues)
		s.queueAt[name] = i
		if i < cap(s.queues) {
			s.queues = s.queues[:i+1] // reuse the slices of an earlier batch
			g := &s.queues[i]
			g.name, g.ids, g.payloads = name, g.ids[:0], g.payloads[:0]
		} else {
			s.queues = append(s.queues, queueGroup{name: name})
		}
	}
	return &s.queues[i]
}

func (s *sidekiqTarget) reset() {
	s.buf = s.buf[:0]
	s.queues = s.queues[:0]
	clear(s.queueAt)
	s.sched.ids, s.sched.pairs = s.sched.ids[:0], s.sched.pairs[:0]
}

// appendSidekiqPayload appends j's Sidekiq job hash as JSON to b, with
// tenant's key when it is on. It returns an error, and b unchanged in
// meaning, for a row no worker could run.
func appendSidekiqPayload(b []byte, j *Job, now time.Time, millis bool, tenant Tenant) ([]byte, error) {
	args, err := check(j)
	if err != nil {
		return b, err
	}
	opts, err := decodeOptions(j.Options)
	if err != nil {
		return b, err
	}
	if err := tenant.check(opts); err != nil {
		return b, err
	}

	b = append(b, `{"class":`...)
	b = AppendJSONString(b, j.Name)
	b = append(b, `,"args":`...)
	b = append(b, args...)
	b = append(b, `,"queue":`...)
	b = AppendJSONString(b, j.Queue)
	b = append(b, `,"jid":`...)
	b = AppendJSONString(b, j.JID)
	if _, ok := opts["retry"]; !ok {
		b = append(b, `,"retry":true`...)
	}
	b = append(b, `,"created_at":`...)
	b = appendTimestamp(b, j.CreatedAt, millis)
	if !j.scheduled(now) {
		b = append(b, `,"enqueued_at":`...)
		b = appendTimestamp(b, now, millis)
	}
	b = append(b, tenant.field...) // names the schema, which options may too
	if len(opts) > 0 {
		keys := make([]string, 0, len(opts))
		for k := range opts {
			keys = append(keys, k)
		}
		slices.Sort(keys)
		// A malformed traceparent is dropped, with its tracestate
		// (relay/trace.go): the job goes without them.
		_, ts, badTrace := TraceOptions(opts)
		for _, k := range keys {
			if (badTrace != "" && isTraceKey(k)) || (k == TracestateKey && ts == "") {
				continue // a tracestate goes only as a string, with a valid traceparent
			}
			if tenant.on() && k == tenant.key {
				continue // written above, once
			}
			b = append(b, ',')
			b = AppendJSONString(b, k)
			b = append(b, ':')
			b = append(b, bytes.TrimSpace(opts[k])...)
		}
	}
	return append(b, '}'), nil
}

// epochSeconds is t as float epoch seconds with microsecond precision.
func epochSeconds(t time.Time) float64 {
	return float64(t.UnixMicro()) / 1e6
}

func appendTimestamp(b []byte, t time.Time, millis bool) []byte {
	if millis {
		return strconv.AppendInt(b, t.UnixMilli(), 10)
	}
	// Float epoch seconds to the microsecond, written from integers (exact,
	// and faster than formatting a float). There is always a decimal point:
	// Ruby's JSON parses 1732891234 as an Integer, which Sidekiq 7 misreads.
	us := t.UnixMicro()
	if us < 0 { // before 1970
		b = append(b, '-')
		us = -us
	}
	sec, frac := us/1e6, us%1e6
	b = strconv.AppendInt(b, sec, 10)
	b = append(b, '.')
	var digits [6]byte
	for i := 5; i >= 0; i-- {
		digits[i] = byte('0' + frac%10)
		frac /= 10
	}
	n := 6
	for n > 1 && digits[n-1] == '0' {
		n--
	}
	return append(b, digits[:n]...)
}
