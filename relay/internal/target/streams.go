package target

import (
	"bytes"
	"encoding/json"
	"fmt"
	"slices"
	"strconv"
	"time"

	"github.com/stagedrain/stagedrain/relay/internal/handoff"
)

// streamsLength is what the streams target's length guards measure: the
// entries a stream's consumer groups have not acknowledged (Redis 7.0's
// consumer group lag).
const streamsLength = "XUNACKED"

// Redis Streams: XADD stream:<q>. Streams have no scheduler: jobs are
// claimed once due.
func init() {
	Register(Spec{
		Name:         "streams",
		Order:        3,
		Help:         "streams (Redis streams)",
		DueOnly:      true,
		StreamMaxLen: true,
		Length:       streamsLength,
		TraceSystem:  "redis",
		OwnedKeys:    []string{"jid", "class", "args", "queue", "created_at", "options", TraceparentKey, TracestateKey},
		Goldens:      []string{"streams_entry.json", "streams_entry_tenant.json"},
		New:          func(o Options) Builder { return newStreamTarget(o) },
	})
}

// streamKeys builds the keys the streams target writes.
type streamKeys struct {
	prefix string // "" or "<namespace>:"
}

func newStreamKeys(namespace string) streamKeys {
	if namespace == "" {
		return streamKeys{}
	}
	return streamKeys{prefix: namespace + ":"}
}

// stream is the stream a queue's jobs are added to.
func (k streamKeys) stream(queue string) string { return k.prefix + "stream:" + queue }

// streamTarget appends each job to the Redis stream of its queue:
//
//	XADD [<namespace>:]stream:<queue> [MAXLEN ~ <n>] * jid <jid> class <job_name>
//	     args <job_args JSON> queue <queue> created_at <epoch ms> [<tenant key> <schema>]
//	     [options <JSON>] [traceparent <traceparent> [tracestate <tracestate>]]
//
// options is written only when the row's options is not {}; the tenant
// field only with Config.TenantKey (relay/tenant.go). Each job is an
// op of its own, so that an error on one entry refuses only that job.
//
// Streams have no scheduler: the relay claims a job only once its run_at is
// due (Spec.DueOnly) and wakes for the next one, so this
// target never sees a future run_at.
//
// A streamTarget is used by one goroutine at a time: it reuses its buffers.
type streamTarget struct {
	keys       streamKeys
	maxLen     int64  // approximate MAXLEN per stream; 0 none
	maxPayload int    // bytes of an entry's field values; a bigger entry is rejected
	tenant     Tenant // written into every entry (relay/tenant.go); zero: none

	ids  []int64 // the batch's ids, one op's slice each
	nums []byte  // the batch's created_at digits, back to back
}

func newStreamTarget(o Options) *streamTarget {
	return &streamTarget{keys: newStreamKeys(o.Namespace), maxLen: o.StreamMaxLen, maxPayload: o.MaxPayload, tenant: o.Tenant}
}

func (s *streamTarget) Add(u *handoff.Unit, batch []Job, now time.Time, res *Result) {
	s.ids, s.nums = s.ids[:0], s.nums[:0]
	s.ids = slices.Grow(s.ids, len(batch)) // never moves: each op keeps a slice of it
	for i := range batch {
		j := &batch[i]
		args, err := check(j)
		var tp, ts string
		if err == nil {
			var o map[string]json.RawMessage
			if o, err = decodeOptions(j.Options); o != nil {
				tp, ts, _ = TraceOptions(o) // a malformed one is dropped (relay/trace.go)
				err = s.tenant.check(o)
			}
		}
		if err != nil {
			res.Rejected = append(res.Rejected, Rejected{ID: j.ID, Reason: err.Error()})
			continue
		}
		opts := bytes.TrimSpace(j.Options)
		if bytes.Equal(opts, []byte("{}")) || (tp != "" && onlyTraceKeys(j.Options)) {
			opts = nil // the trace context has fields of its own
		}
		start := len(s.nums)
		s.nums = strconv.AppendInt(s.nums, j.CreatedAt.UnixMilli(), 10)
		created := s.nums[start:len(s.nums):len(s.nums)]
		if n := len(j.JID) + len(j.Name) + len(args) + len(j.Queue) + len(created) + len(opts) + len(tp) + len(ts) + len(s.tenant.schema); n > s.maxPayload {
			s.nums = s.nums[:start]
			res.Rejected = append(res.Rejected, Rejected{ID: j.ID, Reason: fmt.Sprintf("stream entry is %d bytes, over the limit of %d (MaxPayloadBytes)", n, s.maxPayload)})
			continue
		}
		s.ids = append(s.ids, j.ID)
		u.Begin(s.ids[len(s.ids)-1 : len(s.ids) : len(s.ids)])
		u.Limit(j.Queue, streamsLength, s.keys.stream(j.Queue)) // what consumer groups have not acknowledged
		cmd := make([]any, 0, 16)
		if s.maxLen > 0 {
			cmd = append(cmd, "MAXLEN", "~", s.maxLen)
		}
		cmd = append(cmd, "*", "jid", j.JID, "class", j.Name, "args", args, "queue", j.Queue, "created_at", created)
		if s.tenant.on() {
			cmd = append(cmd, s.tenant.key, s.tenant.schema)
		}
		if opts != nil {
			cmd = append(cmd, "options", opts)
		}
		if tp != "" {
			cmd = append(cmd, TraceparentKey, tp)
			if ts != "" {
				cmd = append(cmd, TracestateKey, ts)
			}
		}
		u.Command("XADD", s.keys.stream(j.Queue), cmd...)
		if !slices.Contains(res.Queues, j.Queue) {
			res.Queues = append(res.Queues, j.Queue)
		}
	}
}
