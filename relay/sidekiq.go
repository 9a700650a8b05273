package relay

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/redis/go-redis/v9"
)

// sidekiqSink pushes batches in Sidekiq's layout (see keys.go): an immediate
// job is SADD queues <q> + LPUSH queue:<q> <json>; a job whose run_at is in
// the future is ZADD schedule <epoch seconds> <json>. A whole batch, however
// many queues it mixes, goes in one MULTI/EXEC round trip.
//
// A job counts as pushed only on positive evidence (txOutcome): EXEC ran and
// answered the job's command with a success reply. Redis may refuse part of
// an executed batch (a WRONGTYPE on one queue's key): the jobs of the other
// queues still count as pushed, and only the refused ones are held back, so
// one bad key does not hold up every queue. A refusal that waiting cannot
// fix makes its jobs poison (refused); one that it can (OOM, READONLY, see
// isTransientReply) leaves them staged (deferred).
//
// A sidekiqSink is used by one goroutine at a time: it reuses its buffers.
type sidekiqSink struct {
	rdb        redis.UniversalClient
	keys       sidekiqKeys
	ts         TimestampFormat
	maxPayload int // bytes; a bigger payload is rejected

	buf     []byte         // every payload of the batch, back to back
	queues  []queueGroup   // immediate jobs by queue, queues in order of first use
	queueAt map[string]int // queue name -> index in queues
	sched   scheduleGroup  // scheduled jobs

	jobCmds  []jobCmd // the LPUSHes, then the ZADD, of the batch
	refusals []error  // txOutcome's verdict on each of jobCmds
}

type queueGroup struct {
	name     string
	ids      []int64
	payloads []any
	cmd      *redis.IntCmd // the LPUSH
}

type scheduleGroup struct {
	ids []int64
	zs  []redis.Z
	cmd *redis.IntCmd // the ZADD
}

// rejectedJob is a row that was not pushed, and why.
type rejectedJob struct {
	id     int64
	reason string
}

// pushResult says which rows of a batch went to Redis.
type pushResult struct {
	pushed    []int64
	rejected  []rejectedJob // poison: no worker could run them, or too big; not sent
	refused   []rejectedJob // poison: sent, and Redis answered an error waiting cannot fix
	deferred  []rejectedJob // sent, and Redis answered an error waiting may fix: stay staged
	queues    []string      // the queues of the immediate jobs, for the log
	scheduled int           // how many jobs were scheduled, for the log
}

func newSidekiqSink(rdb redis.UniversalClient, namespace string, ts TimestampFormat, maxPayload int) *sidekiqSink {
	return &sidekiqSink{rdb: rdb, keys: newSidekiqKeys(namespace), ts: ts, maxPayload: maxPayload, queueAt: make(map[string]int)}
}

// push writes batch to Redis in one round trip. now is the enqueue time: a
// job whose run_at is after now is scheduled, any other runs at once. An
// error means nothing is known to have been pushed: retry the whole batch.
// So is a batch that Redis refused whole, for reasons that waiting may fix.
func (s *sidekiqSink) push(ctx context.Context, batch []stagedJob, now time.Time) (pushResult, error) {
	var res pushResult
	s.build(batch, now, &res)
	if len(s.queues) == 0 && len(s.sched.ids) == 0 {
		return res, nil
	}

	executed, err := s.rdb.TxPipelined(ctx, func(p redis.Pipeliner) error {
		for i := range s.queues {
			g := &s.queues[i]
			p.SAdd(ctx, s.keys.queues(), g.name)
			g.cmd = p.LPush(ctx, s.keys.queue(g.name), g.payloads...)
		}
		if len(s.sched.ids) > 0 {
			s.sched.cmd = p.ZAdd(ctx, s.keys.schedule(), s.sched.zs...)
		}
		p.Ping(ctx) // last: its PONG proves that EXEC ran (see txOutcome)
		return nil
	})
	s.jobCmds = s.jobCmds[:0]
	for _, g := range s.queues {
		s.jobCmds = append(s.jobCmds, jobCmd{cmd: g.cmd, min: int64(len(g.payloads)), max: math.MaxInt64})
	}
	if s.sched.cmd != nil {
		s.jobCmds = append(s.jobCmds, jobCmd{cmd: s.sched.cmd, min: 0, max: int64(len(s.sched.zs))})
	}
	s.refusals, err = txOutcome(s.refusals[:0], executed, err, s.jobCmds)
	if err != nil {
		return pushResult{}, fmt.Errorf("push batch: %w", err)
	}
	// SADD queues only feeds Sidekiq's UI: a job is pushed when its LPUSH is.
	collect := func(ids []int64, refusal error) {
		if refusal != nil {
			to := &res.refused
			if isTransientReply(refusal) {
				to = &res.deferred
			}
			for _, id := range ids {
				*to = append(*to, rejectedJob{id: id, reason: refusal.Error()})
			}
			return
		}
		res.pushed = append(res.pushed, ids...)
	}
	for i, g := range s.queues {
		collect(g.ids, s.refusals[i])
	}
	if s.sched.cmd != nil {
		collect(s.sched.ids, s.refusals[len(s.queues)])
	}
	res.queues = make([]string, len(s.queues))
	for i, g := range s.queues {
		res.queues[i] = g.name
	}
	res.scheduled = len(s.sched.ids)
	if len(res.pushed)+len(res.rejected)+len(res.refused) == 0 {
		// Nothing went anywhere: wait, with backoff, rather than spin.
		return pushResult{}, fmt.Errorf("push batch: Redis refused all %d jobs: %s", len(res.deferred), res.deferred[0].reason)
	}
	return res, nil
}

// isTransientReply reports whether err, Redis's error reply to one command
// of an executed transaction, is one that waiting may fix: out of memory, a
// replica or a server still loading, a busy script, a cluster or a primary
// that is down or failing over, an ACL that denies the key (an operator's
// fix for every job alike). Any other reply (WRONGTYPE; "ERR string exceeds
// maximum allowed size") would refuse the same job again: it is poison.
func isTransientReply(err error) bool {
	code, _, _ := strings.Cut(err.Error(), " ")
	switch code {
	case "OOM", "READONLY", "LOADING", "BUSY", "TRYAGAIN", "CLUSTERDOWN", "MASTERDOWN",
		"NOREPLICAS", "MISCONF", "MOVED", "ASK", "NOPERM", "NOAUTH", "WRONGPASS":
		return true
	}
	return false
}

// jobCmd is a command of a push transaction that carries jobs (an LPUSH or
// the ZADD) and the range its integer reply lies in when Redis ran it:
// LPUSH answers the list's new length, at least the number of payloads; ZADD
// the number of members added, at most the number given.
type jobCmd struct {
	cmd      *redis.IntCmd
	min, max int64
}

// txOutcome decides which job commands of a MULTI/EXEC pushed their jobs,
// from the commands TxPipelined executed (a PING last) and the error it
// returned. A job counts as pushed only on positive evidence: EXEC ran, and
// Redis answered the job's command with an integer in its range.
//
// EXEC ran when the PING queued last answered PONG: replies are read in
// order, so every command before it was answered too. A reply the client
// never read leaves a command with neither an error nor a value, which is
// what go-redis leaves behind when Redis refuses the connection's setup
// (HELLO, AUTH, SELECT): that, EXECABORT, a timeout, a missing or
// mistyped reply, or an error no executed command carries is an error here,
// and the whole batch stays staged.
//
// Otherwise txOutcome appends to dst one entry per job command, in order:
// nil when its jobs were pushed, or the error Redis answered it with (a
// WRONGTYPE on one queue's key): those jobs are refused and stay staged
// while the others count as pushed.
func txOutcome(dst []error, executed []redis.Cmder, execErr error, jobs []jobCmd) ([]error, error) {
	if len(executed) == 0 {
		return dst, fmt.Errorf("transaction not run: %w", cmp.Or(execErr, errNoReply))
	}
	ping, ok := executed[len(executed)-1].(*redis.StatusCmd)
	if !ok || ping.Err() != nil || ping.Val() != "PONG" {
		var pingErr error
		if ok {
			pingErr = ping.Err()
		}
		err := cmp.Or(execErr, pingErr, errNoReply)
		if cause := queueRefusal(executed); cause != nil && redis.IsExecAbortError(err) {
			// Say why Redis discarded it (OOM under maxmemory, say).
			return dst, fmt.Errorf("transaction not confirmed: %w (%w)", err, cause)
		}
		return dst, fmt.Errorf("transaction not confirmed: %w", err)
	}
	if execErr != nil && (!isCommandError(execErr) || !carriedByOne(executed, execErr)) {
		return dst, execErr
	}
	for _, j := range jobs {
		err, val := j.cmd.Err(), j.cmd.Val()
		switch {
		case err == nil && val >= j.min && val <= j.max:
			dst = append(dst, nil)
		case err != nil && isCommandError(err):
			dst = append(dst, err)
		case err != nil:
			return dst, fmt.Errorf("%s: %w", j.cmd.Name(), err)
		default:
			return dst, fmt.Errorf("%s: reply %d, want %d to %d: %w", j.cmd.Name(), val, j.min, j.max, errNoReply)
		}
	}
	return dst, nil
}

var errNoReply = errors.New("no reply proves that Redis ran the transaction")

// queueRefusal returns the first error reply with which Redis refused to
// queue a command of a MULTI (which then made EXEC answer EXECABORT), or nil.
func queueRefusal(cmds []redis.Cmder) error {
	for _, c := range cmds {
		if err := c.Err(); err != nil && isCommandError(err) {
			return err
		}
	}
	return nil
}

// isCommandError reports whether err is Redis's answer to one command of an
// executed transaction (say WRONGTYPE), rather than a failure of the whole.
func isCommandError(err error) bool {
	_, ok := err.(redis.Error) // not wrapped: go-redis wraps setup failures
	return ok && !redis.IsExecAbortError(err) && !errors.Is(err, redis.TxFailedErr)
}

// carriedByOne reports whether err is the error of one of cmds.
func carriedByOne(cmds []redis.Cmder, err error) bool {
	for _, c := range cmds {
		if errors.Is(c.Err(), err) {
			return true
		}
	}
	return false
}

// build resets the sink and builds batch's payloads into it, grouped by
// queue (immediate jobs) or into the schedule; rows no worker could run are
// added to res.rejected. It allocates nothing per job once the sink's
// buffers have grown to the batch size.
func (s *sidekiqSink) build(batch []stagedJob, now time.Time, res *pushResult) {
	s.reset()
	for i := range batch {
		j := &batch[i]
		start := len(s.buf)
		var err error
		s.buf, err = appendSidekiqPayload(s.buf, j, now, s.ts)
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
			s.sched.zs = append(s.sched.zs, redis.Z{Score: epochSeconds(*j.runAt), Member: payload})
			continue
		}
		g := s.group(j.queue)
		g.ids = append(g.ids, j.id)
		g.payloads = append(g.payloads, payload)
	}
}

// group returns the queue group for name, adding it on first use.
func (s *sidekiqSink) group(name string) *queueGroup {
	i, ok := s.queueAt[name]
	if !ok {
		i = len(s.queues)
		s.queueAt[name] = i
		if i < cap(s.queues) {
			s.queues = s.queues[:i+1] // reuse the slices of an earlier batch
			g := &s.queues[i]
			g.name, g.ids, g.payloads, g.cmd = name, g.ids[:0], g.payloads[:0], nil
		} else {
			s.queues = append(s.queues, queueGroup{name: name})
		}
	}
	return &s.queues[i]
}

func (s *sidekiqSink) reset() {
	s.buf = s.buf[:0]
	s.queues = s.queues[:0]
	clear(s.queueAt)
	s.sched.ids, s.sched.zs, s.sched.cmd = s.sched.ids[:0], s.sched.zs[:0], nil
}

func isScheduled(j *stagedJob, now time.Time) bool {
	return j.runAt != nil && j.runAt.After(now)
}

// reservedKeys are written from columns; options may not set them. The
// table's CHECK constraint rejects them at INSERT; this guards tables
// migrated by hand.
var reservedKeys = [...]string{"class", "args", "queue", "jid", "created_at", "enqueued_at", "at"}

// appendSidekiqPayload appends j's Sidekiq job hash as JSON to b. It returns
// an error, and b unchanged in meaning, for a row no worker could run.
func appendSidekiqPayload(b []byte, j *stagedJob, now time.Time, ts TimestampFormat) ([]byte, error) {
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
	if len(opts) > 0 {
		keys := make([]string, 0, len(opts))
		for k := range opts {
			keys = append(keys, k)
		}
		slices.Sort(keys)
		for _, k := range keys {
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
