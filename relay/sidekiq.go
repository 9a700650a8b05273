package relay

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"time"
	"unicode/utf8"

	"github.com/stagedrain/stagedrain/relay/internal/handoff"
)

// sidekiqTarget writes batches in Sidekiq's layout (see keys.go): an
// immediate job is SADD queues <q> + LPUSH queue:<q> <json>; a job whose
// run_at is in the future is ZADD schedule <epoch seconds> <json>. It only
// builds the commands: the relay runs them, with its fence and record, in
// one atomic step (internal/handoff), one op per queue and one for the schedule,
// so a WRONGTYPE on one queue's key refuses only that queue's jobs.
//
// A sidekiqTarget is used by one goroutine at a time: it reuses its buffers.
type sidekiqTarget struct {
	keys       sidekiqKeys
	ts         TimestampFormat
	maxPayload int       // bytes; a bigger payload is rejected
	tenant     tenantTag // written into every job (tenant.go); zero: none

	buf     []byte         // every payload of the batch, back to back
	queues  []queueGroup   // immediate jobs by queue, queues in order of first use
	queueAt map[string]int // queue name -> index in queues
	sched   scheduleGroup  // scheduled jobs
	names   []any          // the queue names, for SADD queues
}

type queueGroup struct {
	name     string
	ids      []int64
	payloads []any
}

type scheduleGroup struct {
	ids   []int64
	pairs []any // score, member, score, member, ...
}

func newSidekiqTarget(namespace string, ts TimestampFormat, maxPayload int) *sidekiqTarget {
	return &sidekiqTarget{keys: newSidekiqKeys(namespace), ts: ts, maxPayload: maxPayload, queueAt: make(map[string]int)}
}

// add builds batch into u: its payloads, grouped by queue, and the commands
// that push them. now is the enqueue time: a job whose run_at is after now
// is scheduled, any other runs at once. Rows no worker could run are added
// to res.rejected.
func (s *sidekiqTarget) add(u *handoff.Unit, batch []stagedJob, now time.Time, res *pushResult) {
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
		u.Limit(g.name, "LLEN", s.keys.queue(g.name))
		u.Variadic("LPUSH", s.keys.queue(g.name), 1, g.payloads)
		res.queues = append(res.queues, g.name)
	}
	if len(s.sched.ids) > 0 {
		u.Begin(s.sched.ids, "")
		u.Variadic("ZADD", s.keys.schedule(), 2, s.sched.pairs)
		res.scheduled = len(s.sched.ids)
	}
}

// build resets the target and builds batch's payloads into it, grouped by
// queue (immediate jobs) or into the schedule; rows no worker could run are
// added to res.rejected. It allocates nothing per job once the target's
// buffers have grown to the batch size, but for boxing each payload (and a
// scheduled job's score) into an argument.
func (s *sidekiqTarget) build(batch []stagedJob, now time.Time, res *pushResult) {
	s.reset()
	for i := range batch {
		j := &batch[i]
		start := len(s.buf)
		var err error
		s.buf, err = appendSidekiqPayload(s.buf, j, now, s.ts, s.tenant)
		if err != nil {
			s.buf = s.buf[:start]
			res.rejected = append(res.rejected, rejectedJob{id: j.id, reason: err.Error()})
			continue
		}
		if n := len(s.buf) - start; n > s.maxPayload {
			s.buf = s.buf[:start]
			res.rejected = append(res.rejected, rejectedJob{id: j.id,
				reason: fmt.Sprintf("payload is %d bytes, over the limit of %d (MaxPayloadBytes)", n, s.maxPayload)})
			continue
		}
		// Appending may move buf, but never rewrites bytes already written,
		// so this slice stays valid until the next batch resets buf.
		payload := s.buf[start:len(s.buf):len(s.buf)]
		if isScheduled(j, now) {
			s.sched.ids = append(s.sched.ids, j.id)
			s.sched.pairs = append(s.sched.pairs, epochSeconds(*j.runAt), payload)
			continue
		}
		g := s.group(j.queue)
		g.ids = append(g.ids, j.id)
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

func isScheduled(j *stagedJob, now time.Time) bool {
	return j.runAt != nil && j.runAt.After(now)
}

// reservedKeys are written from columns; options may not set them. The
// table's CHECK constraint rejects them at INSERT; this guards tables
// migrated by hand.
var reservedKeys = [...]string{"class", "args", "queue", "jid", "created_at", "enqueued_at", "at"}

// appendSidekiqPayload appends j's Sidekiq job hash as JSON to b, with
// tenant's key when it is on. It returns an error, and b unchanged in
// meaning, for a row no worker could run.
func appendSidekiqPayload(b []byte, j *stagedJob, now time.Time, ts TimestampFormat, tenant tenantTag) ([]byte, error) {
	if j.bad != "" {
		return b, errors.New(j.bad)
	}
	if j.nulls != 0 {
		return b, fmt.Errorf("%s is NULL", j.nulls)
	}
	if j.name == "" {
		return b, errors.New("job_name is empty")
	}
	if j.queue == "" {
		return b, errors.New("queue is empty")
	}
	args := bytes.TrimSpace(j.args)
	if len(args) == 0 || args[0] != '[' {
		return b, errors.New("job_args is not a JSON array")
	}
	opts, err := decodeOptions(j.options)
	if err != nil {
		return b, err
	}
	if err := tenant.check(opts); err != nil {
		return b, err
	}

	b = append(b, `{"class":`...)
	b = appendJSONString(b, j.name)
	b = append(b, `,"args":`...)
	b = append(b, args...)
	b = append(b, `,"queue":`...)
	b = appendJSONString(b, j.queue)
	b = append(b, `,"jid":`...)
	b = appendJSONString(b, j.jid)
	if _, ok := opts["retry"]; !ok {
		b = append(b, `,"retry":true`...)
	}
	b = append(b, `,"created_at":`...)
	b = appendTimestamp(b, j.createdAt, ts)
	if !isScheduled(j, now) {
		b = append(b, `,"enqueued_at":`...)
		b = appendTimestamp(b, now, ts)
	}
	b = append(b, tenant.field...) // names the schema, which options may too
	if len(opts) > 0 {
		keys := make([]string, 0, len(opts))
		for k := range opts {
			keys = append(keys, k)
		}
		slices.Sort(keys)
		// A malformed traceparent is dropped, with its tracestate
		// (trace.go): the job goes without them.
		_, ts, badTrace := traceOptions(opts)
		for _, k := range keys {
			if (badTrace != "" && isTraceKey(k)) || (k == tracestateKey && ts == "") {
				continue // a tracestate goes only as a string, with a valid traceparent
			}
			if tenant.on() && k == tenant.key {
				continue // written above, once
			}
			b = append(b, ',')
			b = appendJSONString(b, k)
			b = append(b, ':')
			b = append(b, bytes.TrimSpace(opts[k])...)
		}
	}
	return append(b, '}'), nil
}

// decodeOptions returns the fields of a row's options, or nil for the
// common "{}" without allocating.
func decodeOptions(raw []byte) (map[string]json.RawMessage, error) {
	o := bytes.TrimSpace(raw)
	if len(o) == 0 || bytes.Equal(o, []byte("{}")) {
		return nil, nil
	}
	var opts map[string]json.RawMessage
	if err := json.Unmarshal(o, &opts); err != nil || opts == nil {
		return nil, errors.New("options is not a JSON object")
	}
	for _, k := range reservedKeys {
		if _, ok := opts[k]; ok {
			return nil, fmt.Errorf("options sets %q, which comes from a column", k)
		}
	}
	return opts, nil
}

// epochSeconds is t as float epoch seconds with microsecond precision.
func epochSeconds(t time.Time) float64 {
	return float64(t.UnixMicro()) / 1e6
}

func appendTimestamp(b []byte, t time.Time, ts TimestampFormat) []byte {
	if ts == TimestampMillis {
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

const hexDigits = "0123456789abcdef"

// appendJSONString appends s as a JSON string. Invalid UTF-8 becomes U+FFFD.
func appendJSONString(b []byte, s string) []byte {
	b = append(b, '"')
	for i := 0; i < len(s); {
		c := s[i]
		if c < utf8.RuneSelf {
			switch {
			case c == '"' || c == '\\':
				b = append(b, '\\', c)
			case c == '\n':
				b = append(b, '\\', 'n')
			case c == '\r':
				b = append(b, '\\', 'r')
			case c == '\t':
				b = append(b, '\\', 't')
			case c < 0x20:
				b = append(b, '\\', 'u', '0', '0', hexDigits[c>>4], hexDigits[c&0xf])
			default:
				b = append(b, c)
			}
			i++
			continue
		}
		r, size := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError && size == 1 {
			b = append(b, `\ufffd`...)
		} else {
			b = append(b, s[i:i+size]...)
		}
		i += size
	}
	return append(b, '"')
}
