package relay

import (
	"bytes"
	"encoding/json"
	"fmt"
	"slices"
	"strconv"
	"time"

	"github.com/stagedrain/stagedrain/relay/internal/handoff"
)

// streamTarget appends each job to the Redis stream of its queue:
//
//	XADD [<namespace>:]stream:<queue> [MAXLEN ~ <n>] * jid <jid> class <job_name>
//	     args <job_args JSON> queue <queue> created_at <epoch ms> [<tenant key> <schema>]
//	     [options <JSON>] [traceparent <traceparent> [tracestate <tracestate>]]
//
// options is written only when the row's options is not {}; the tenant
// field only with Config.TenantKey (tenant.go). Each job is an
// op of its own, so that an error on one entry refuses only that job.
//
// Streams have no scheduler: the relay claims a job only once its run_at is
// due (tableSQL.claimDue) and wakes for the next one (Relay.nextDue), so this
// target never sees a future run_at.
//
// A streamTarget is used by one goroutine at a time: it reuses its buffers.
type streamTarget struct {
	keys       streamKeys
	maxLen     int64     // approximate MAXLEN per stream; 0 none
	maxPayload int       // bytes of an entry's field values; a bigger entry is rejected
	tenant     tenantTag // written into every entry (tenant.go); zero: none

	ids  []int64 // the batch's ids, one op's slice each
	nums []byte  // the batch's created_at digits, back to back
}

func newStreamTarget(namespace string, maxLen int64, maxPayload int) *streamTarget {
	return &streamTarget{keys: newStreamKeys(namespace), maxLen: maxLen, maxPayload: maxPayload}
}

func (s *streamTarget) add(u *handoff.Unit, batch []stagedJob, now time.Time, res *pushResult) {
	s.ids, s.nums = s.ids[:0], s.nums[:0]
	s.ids = slices.Grow(s.ids, len(batch)) // never moves: each op keeps a slice of it
	for i := range batch {
		j := &batch[i]
		args, err := checkJob(j)
		var tp, ts string
		if err == nil {
			var o map[string]json.RawMessage
			if o, err = decodeOptions(j.options); o != nil {
				tp, ts, _ = traceOptions(o) // a malformed one is dropped (trace.go)
				err = s.tenant.check(o)
			}
		}
		if err != nil {
			res.rejected = append(res.rejected, rejectedJob{id: j.id, reason: err.Error()})
			continue
		}
		opts := bytes.TrimSpace(j.options)
		if bytes.Equal(opts, []byte("{}")) || (tp != "" && onlyTraceKeys(j.options)) {
			opts = nil // the trace context has fields of its own
		}
		start := len(s.nums)
		s.nums = strconv.AppendInt(s.nums, j.createdAt.UnixMilli(), 10)
		created := s.nums[start:len(s.nums):len(s.nums)]
		if n := len(j.jid) + len(j.name) + len(args) + len(j.queue) + len(created) + len(opts) + len(tp) + len(ts) + len(s.tenant.schema); n > s.maxPayload {
			s.nums = s.nums[:start]
			res.rejected = append(res.rejected, rejectedJob{id: j.id,
				reason: fmt.Sprintf("stream entry is %d bytes, over the limit of %d (MaxPayloadBytes)", n, s.maxPayload)})
			continue
		}
		s.ids = append(s.ids, j.id)
		u.Begin(s.ids[len(s.ids)-1 : len(s.ids) : len(s.ids)])
		u.Limit(j.queue, "XUNACKED", s.keys.stream(j.queue)) // what consumer groups have not acknowledged
		cmd := make([]any, 0, 16)
		if s.maxLen > 0 {
			cmd = append(cmd, "MAXLEN", "~", s.maxLen)
		}
		cmd = append(cmd, "*", "jid", j.jid, "class", j.name, "args", args, "queue", j.queue, "created_at", created)
		if s.tenant.on() {
			cmd = append(cmd, s.tenant.key, s.tenant.schema)
		}
		if opts != nil {
			cmd = append(cmd, "options", opts)
		}
		if tp != "" {
			cmd = append(cmd, traceparentKey, tp)
			if ts != "" {
				cmd = append(cmd, tracestateKey, ts)
			}
		}
		u.Command("XADD", s.keys.stream(j.queue), cmd...)
		if !slices.Contains(res.queues, j.queue) {
			res.queues = append(res.queues, j.queue)
		}
	}
}
