package target

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/stagedrain/stagedrain/relay/internal/handoff"
)

// bullmqLength is what the bullmq target's length guards measure: a
// queue's wait and paused lists and its prioritized set.
const bullmqLength = "LLEN+LLEN+ZCARD"

// BullMQ 6: the handoff's Lua op handoff.BullMQAdd.
func init() {
	Register(Spec{
		Name:        "bullmq",
		Order:       4,
		Help:        "bullmq (BullMQ 6)",
		Length:      bullmqLength,
		TraceSystem: "bullmq",
		OwnedKeys:   bullmqOwnedKeys(),
		Goldens:     []string{"bullmq_standard.json", "bullmq_prioritized.json", "bullmq_delayed.json"},
		New:         func(o Options) Builder { return newBullmqTarget(o) },
	})
}

// The bullmq target writes each job as BullMQ 6.7.0 (npm bullmq, MIT) adds
// it with Queue.add, so that a BullMQ Worker runs it: the job's name is
// job_name, its data job_args, its id the jid (a custom jobId), its queue
// the queue, and the prefix of every key Config.RedisNamespace ("bull", as
// BullMQ's, when it is empty). BullMQ adds a job with one of three Lua
// scripts (src/commands/addStandardJob-9.lua, addPrioritizedJob-9.lua and
// addDelayedJob-6.lua, with their includes/), chosen by its options as
// RedisQueueBackend.addJobToTransaction (src/classes/redis-queue-backend.ts)
// does: a delay above 0 makes a delayed job, else a priority above 0 a
// prioritized one, else a standard one. Each does, for a new id:
//
//	INCR <p>:<q>:id                         the job counter, even for a custom id
//	HGET/HSET <p>:<q>:meta opts.maxLenEvents the events stream's length, 10000 if unset (getOrSetMaxEvents)
//	HMSET <p>:<q>:<id> name data opts timestamp delay priority   (storeJob)
//	XADD <p>:<q>:events * event added jobId <id> name <name>
//
// then a standard job: LPUSH <p>:<q>:wait <id> (RPUSH with lifo), ZADD
// <p>:<q>:marker 0 "0" unless the queue is paused or at its global
// concurrency (isQueuePausedOrMaxed: meta's paused and concurrency, LLEN
// active; BullMQ 6 keeps a paused queue's jobs in wait, not in paused as 5
// did), XADD events MAXLEN ~ <n> * event waiting jobId <id>; a prioritized
// job: INCR <p>:<q>:pc, ZADD <p>:<q>:prioritized priority*2^32+pc%2^32 <id>,
// the marker as for a standard job, the waiting event; a delayed job: ZADD
// <p>:<q>:delayed with the score of getDelayedScore (the due time in ms
// times 0x1000, plus one per job already due in that ms), XADD events
// event delayed jobId <id> delay <due ms>, and ZADD marker <the earliest
// delayed score / 0x1000> "1" (addDelayMarkerIfNeeded).
//
// What they do depends on what Redis holds (meta, active, delayed), so the
// relay runs that Lua itself, inside its push script (handoff.BullMQAdd, a Lua op
// of the handoff's push script): the same commands in the same order. Each
// job is an op of its own, guarded by its job key: a job whose key exists
// is skipped and its row deleted, as BullMQ's add of an existing custom id
// is a no-op (handleDuplicatedJob; the relay writes no "duplicated" event).
//
// The job's timestamp is its created_at in ms, and a job whose run_at is
// after now is delayed by run_at - created_at, so it is due at run_at. Its
// opts are what Queue.add stores (Job's constructor sets attempts 0 and
// normalizes backoff; optsAsJSON in redis-queue-backend.ts shortens
// keepLogs to kl and telemetry to tm and omc): attempts, jobId, delay (a
// delayed job), then the row's options as setOptions maps them.
//
// A bullmqTarget is used by one goroutine at a time: it reuses its buffers.
type bullmqTarget struct {
	keys       bullmqKeys
	maxPayload int    // bytes of data plus opts; a bigger job is rejected
	tenant     Tenant // in every job's opts (relay/tenant.go); zero: none
	cluster    bool   // Redis Cluster: a job's keys must share a slot

	ids  []int64 // the batch's ids, one op's slice each
	opts []byte  // the batch's opts JSON, back to back
}

// bullmqDefaultPrefix is BullMQ's default prefix (QueueBase's opts.prefix).
const bullmqDefaultPrefix = "bull"

func newBullmqTarget(o Options) *bullmqTarget {
	prefix := o.Namespace
	if prefix == "" {
		prefix = bullmqDefaultPrefix
	}
	return &bullmqTarget{keys: bullmqKeys{prefix: prefix}, maxPayload: o.MaxPayload, cluster: o.Cluster, tenant: o.Tenant}
}

// bullmqKeys builds the keys of BullMQ's queues, as QueueKeys
// (src/classes/queue-keys.ts) names them: <prefix>:<queue>:<suffix>, and
// a job's hash <prefix>:<queue>:<id>.
type bullmqKeys struct {
	prefix string
}

func (k bullmqKeys) key(queue, suffix string) string { return k.prefix + ":" + queue + ":" + suffix }

// bullmqJob is a row as a BullMQ job.
type bullmqJob struct {
	data      []byte // the job's data, JSON text
	timestamp int64  // ms
	delay     int64  // ms; > 0: a delayed job
	priority  int64  // > 0: a prioritized job (when not delayed)
	lifo      bool
	unwrap    bool // data is job_args' only element

	// The options written into opts, in this order, each a JSON value.
	attempts json.RawMessage
	fields   []bullmqField
}

type bullmqField struct {
	key   string
	value []byte
}

func (b *bullmqTarget) Add(u *handoff.Unit, batch []Job, now time.Time, res *Result) {
	b.ids, b.opts = b.ids[:0], b.opts[:0]
	b.ids = slices.Grow(b.ids, len(batch)) // never moves: each op keeps a slice of it
	for i := range batch {
		j := &batch[i]
		job, err := b.newJob(j, now)
		if err != nil {
			res.Rejected = append(res.Rejected, Rejected{ID: j.ID, Reason: err.Error()})
			continue
		}
		start := len(b.opts)
		b.opts = job.appendOpts(b.opts, j.JID)
		opts := b.opts[start:len(b.opts):len(b.opts)]
		if n := len(job.data) + len(opts); n > b.maxPayload {
			b.opts = b.opts[:start]
			res.Rejected = append(res.Rejected, Rejected{ID: j.ID, Reason: fmt.Sprintf("BullMQ job is %d bytes (data and opts), over the limit of %d (MaxPayloadBytes)", n, b.maxPayload)})
			continue
		}
		b.ids = append(b.ids, j.ID)
		q := j.Queue
		u.Begin(b.ids[len(b.ids)-1:len(b.ids):len(b.ids)], b.keys.key(q, j.JID))
		keys := []string{b.keys.key(q, j.JID), b.keys.key(q, "meta"), b.keys.key(q, "id"), b.keys.key(q, "events"), b.keys.key(q, "marker")}
		args := []any{"", j.JID, j.Name, job.data, opts, job.timestamp, job.delay, job.priority, ""}
		if job.lifo {
			args[8] = "1"
		}
		switch {
		case job.delay > 0:
			args[0] = "delayed"
			keys = append(keys, b.keys.key(q, "delayed"))
			res.Scheduled++
		case job.priority > 0:
			args[0] = "prioritized"
			keys = append(keys, b.keys.key(q, "prioritized"), b.keys.key(q, "active"), b.keys.key(q, "pc"))
		default:
			args[0] = "wait"
			keys = append(keys, b.keys.key(q, "wait"), b.keys.key(q, "active"))
		}
		if job.delay <= 0 {
			// Backpressure: what waits for a worker, as BullMQ's
			// getWaitPlusPrioritizedCount counts it, and a paused list left
			// by BullMQ 5.
			u.Limit(q, bullmqLength, b.keys.key(q, "wait"), b.keys.key(q, "paused"), b.keys.key(q, "prioritized"))
			if !slices.Contains(res.Queues, q) {
				res.Queues = append(res.Queues, q)
			}
		}
		u.Call(handoff.BullMQAdd, keys, args...)
	}
}

// newJob maps a row onto a BullMQ job, or says why no BullMQ worker could
// run it.
func (b *bullmqTarget) newJob(j *Job, now time.Time) (bullmqJob, error) {
	args, err := check(j)
	if err != nil {
		return bullmqJob{}, err
	}
	if err := checkBullmqNames(j); err != nil {
		return bullmqJob{}, err
	}
	if b.cluster {
		if err := b.checkSlot(j); err != nil {
			return bullmqJob{}, err
		}
	}
	job := bullmqJob{data: args, timestamp: j.CreatedAt.UnixMilli(), attempts: json.RawMessage("0")}
	if j.scheduled(now) {
		job.delay = max(j.RunAt.UnixMilli()-job.timestamp, 1)
	}
	if err := job.setOptions(j.Options, b.tenant); err != nil {
		return bullmqJob{}, err
	}
	if job.unwrap {
		var elems []json.RawMessage
		if err := json.Unmarshal(args, &elems); err != nil || len(elems) != 1 {
			return bullmqJob{}, fmt.Errorf("options \"unwrapData\" needs job_args of exactly one element (the job's data), got %d", len(elems))
		}
		job.data = bytes.TrimSpace(elems[0])
	}
	for _, f := range job.fields {
		if f.key != "sizeLimit" {
			continue
		}
		// Job.validateOptions: BullMQ's add refuses such a job.
		if limit, _ := strconv.ParseInt(string(f.value), 10, 64); int64(len(job.data)) > limit {
			return bullmqJob{}, fmt.Errorf("the size of job %s exceeds the limit %d bytes (options sizeLimit): data is %d bytes", Truncate(j.Name, 80), limit, len(job.data))
		}
	}
	return job, nil
}

// checkBullmqNames refuses what BullMQ refuses: a queue name with ':'
// (QueueBase), and a custom job id of '0' or starting '0:' (Queue.addJob),
// an integer one, or one with ':' unless it has exactly three parts
// (Job.validateOptions: an integer id would clash with the job counter's).
func checkBullmqNames(j *Job) error {
	switch {
	case strings.Contains(j.Queue, ":"):
		return fmt.Errorf("queue %q contains ':', which BullMQ refuses in a queue name", Truncate(j.Queue, 80))
	case j.JID == "0" || strings.HasPrefix(j.JID, "0:"):
		return fmt.Errorf("jid %q is '0' or starts with '0:', which BullMQ refuses as a job id", Truncate(j.JID, 80))
	case jsInteger(j.JID):
		return fmt.Errorf("jid %q is an integer, which BullMQ refuses as a custom job id (its own ids are integers)", j.JID)
	case strings.Contains(j.JID, ":") && strings.Count(j.JID, ":") != 2:
		return fmt.Errorf("jid %q contains ':', which BullMQ refuses in a custom job id", Truncate(j.JID, 80))
	}
	return nil
}

var jsIntegerText = regexp.MustCompile(`^-?(0|[1-9][0-9]*)$`)

// jsInteger reports whether JavaScript's `${parseInt(s, 10)}` === s, as
// Job.validateOptions tests a custom id: s is an integer in the form
// JavaScript prints it (below 1e21, and exactly as a double prints).
func jsInteger(s string) bool {
	if !jsIntegerText.MatchString(s) || s == "-0" {
		return false
	}
	f, err := strconv.ParseFloat(s, 64)
	if err != nil || math.Abs(f) >= 1e21 {
		return false
	}
	return strconv.FormatFloat(f, 'f', -1, 64) == s
}

// checkSlot refuses, on Redis Cluster, a job whose keys would be in several
// slots: BullMQ's keys share one only through a hash tag in the prefix
// ("{bull}") or in the queue's name ("{mailers}").
func (b *bullmqTarget) checkSlot(j *Job) error {
	s := handoff.KeySlot(b.keys.key(j.Queue, "wait"))
	for _, k := range []string{b.keys.key(j.Queue, j.JID), b.keys.key(j.Queue, "meta"), b.keys.key(j.Queue, "delayed")} {
		if handoff.KeySlot(k) != s {
			return fmt.Errorf("CROSSSLOT on Redis Cluster, BullMQ's keys %s:%s:* share a slot only with a hash tag in the prefix (--redis-namespace '{%s}') or the queue name ('{%s}')",
				b.keys.prefix, Truncate(j.Queue, 80), strings.Trim(b.keys.prefix, "{}"), Truncate(j.Queue, 80))
		}
	}
	return nil
}

// bullmqOptions are the options setOptions maps; bullmqOwnedKeys adds the
// names BullMQ stores opts under, which Config.TenantKey may not take.
var bullmqOptions = []string{"attempts", "backoff", "priority", "lifo", "removeOnComplete", "removeOnFail",
	"keepLogs", "stackTraceLimit", "sizeLimit", "telemetry", "unwrapData", TraceparentKey, TracestateKey}

func bullmqOwnedKeys() []string {
	return append(slices.Clone(bullmqOptions), "jobId", "delay", "timestamp", "kl", "tm", "omc", "de", "fpof", "cpof", "idof", "rdof",
		"parent", "repeat", "repeatJobKey", "prevMillis", "deduplication", "debounce")
}

// setOptions maps a row's options onto BullMQ's job options (JobsOptions,
// src/types/job-options.ts and src/interfaces/base-job-options.ts):
//
//	attempts          an integer of at least 0 (default 0, which BullMQ runs once)
//	backoff           milliseconds (BullMQ's fixed backoff) or an object {type, delay, jitter 0..1}
//	priority          an integer 0 to 2097151; above 0 a prioritized job
//	lifo              a boolean
//	removeOnComplete, removeOnFail  a boolean, an integer, or an object {age, count, limit}
//	keepLogs, stackTraceLimit, sizeLimit  integers of at least 0 (sizeLimit: of data's bytes)
//	telemetry         an object {metadata (text), omitContext (boolean)}, as tm and omc
//	unwrapData        true: data is job_args' only element (an object, say), not the array
//	traceparent, tracestate  the trace context, as BullMQ's telemetry metadata (relay/trace.go)
//	<tenant key>      the tenant, which must be the schema's (relay/tenant.go)
//
// Any other key is an error, with the reason BullMQ's own add would give,
// or the column or feature to use instead.
func (job *bullmqJob) setOptions(raw []byte, tenant Tenant) error {
	opts, err := decodeOptions(raw)
	if err != nil {
		return err
	}
	if err := tenant.check(opts); err != nil {
		return err
	}
	keys := make([]string, 0, len(opts))
	for k := range opts {
		keys = append(keys, k)
	}
	slices.Sort(keys) // the first bad key reported is the same every time
	var metadata []byte
	for _, k := range keys {
		v := bytes.TrimSpace(opts[k])
		if tenant.on() && k == tenant.key {
			continue // checked above; written below
		}
		switch k {
		case TraceparentKey, TracestateKey: // below
		case "attempts":
			if _, err := optionInt(k, v, 0); err != nil {
				return err
			}
			job.attempts = v
		case "backoff":
			if n, err := optionInt(k, v, 0); err == nil {
				// Backoffs.normalize: a number is a fixed backoff.
				job.fields = append(job.fields, bullmqField{k, fmt.Appendf(nil, `{"type":"fixed","delay":%d}`, n)})
				continue
			}
			var b struct {
				Type   *string  `json:"type"`
				Jitter *float64 `json:"jitter"`
			}
			if json.Unmarshal(v, &b) != nil || v[0] != '{' || b.Type == nil {
				return fmt.Errorf("options %q must be milliseconds or an object with a type (fixed, exponential or a custom strategy's), got %s", k, v)
			}
			if b.Jitter != nil && (*b.Jitter < 0 || *b.Jitter > 1) {
				return fmt.Errorf("options %q: jitter should be between 0 and 1, got %v", k, *b.Jitter)
			}
			job.fields = append(job.fields, bullmqField{k, v})
		case "priority":
			if job.priority, err = optionInt(k, v, 0); err != nil || job.priority > 1<<21-1 {
				return fmt.Errorf("options %q must be an integer between 0 and 2097151 (BullMQ's PRIORITY_LIMIT), got %s", k, v)
			}
			job.fields = append(job.fields, bullmqField{k, v})
		case "lifo":
			if err := json.Unmarshal(v, &job.lifo); err != nil {
				return fmt.Errorf("options %q must be a boolean, got %s", k, v)
			}
			job.fields = append(job.fields, bullmqField{k, v})
		case "removeOnComplete", "removeOnFail":
			var keep struct {
				Age   *int64 `json:"age"`
				Count *int64 `json:"count"`
				Limit *int64 `json:"limit"`
			}
			var flag bool
			if json.Unmarshal(v, &flag) != nil && json.Unmarshal(v, new(int64)) != nil && (v[0] != '{' || json.Unmarshal(v, &keep) != nil) {
				return fmt.Errorf("options %q must be a boolean, an integer or an object {age, count, limit} of integers, got %s", k, v)
			}
			job.fields = append(job.fields, bullmqField{k, v})
		case "keepLogs", "stackTraceLimit", "sizeLimit":
			if _, err := optionInt(k, v, 0); err != nil {
				return err
			}
			if k == "keepLogs" {
				k = "kl" // optsEncodeMap
			}
			job.fields = append(job.fields, bullmqField{k, v})
		case "telemetry":
			var tel struct {
				Metadata    *string `json:"metadata"`
				OmitContext *bool   `json:"omitContext"`
			}
			if err := json.Unmarshal(v, &tel); err != nil || v[0] != '{' {
				return fmt.Errorf("options %q must be an object {metadata (text), omitContext (boolean)}, got %s", k, v)
			}
			if tel.Metadata != nil {
				metadata = AppendJSONString(nil, *tel.Metadata)
			}
			if tel.OmitContext != nil {
				job.fields = append(job.fields, bullmqField{"omc", []byte(strconv.FormatBool(*tel.OmitContext))})
			}
		case "unwrapData":
			if err := json.Unmarshal(v, &job.unwrap); err != nil {
				return fmt.Errorf("options %q must be a boolean, got %s", k, v)
			}
		case "delay":
			return errors.New(`options sets "delay": stage a delayed BullMQ job with run_at`)
		case "timestamp":
			return errors.New(`options sets "timestamp": a BullMQ job's timestamp is its created_at`)
		case "jobId":
			return errors.New(`options sets "jobId": a BullMQ job's id is the row's jid`)
		case "repeat", "repeatJobKey", "prevMillis":
			return fmt.Errorf("options sets %q: repeatable jobs are BullMQ's job schedulers (Queue.upsertJobScheduler), which the bullmq target does not write", k)
		case "parent", "failParentOnFailure", "continueParentOnFailure", "ignoreDependencyOnFailure", "removeDependencyOnFailure":
			return fmt.Errorf("options sets %q: the bullmq target does not write flows (parent and child jobs)", k)
		case "deduplication", "debounce":
			return fmt.Errorf("options sets %q: the bullmq target does not deduplicate; the jid already makes a second add of the same job a no-op", k)
		default:
			return fmt.Errorf("options sets %q, which the bullmq target does not map (it maps %s)", k, strings.Join(bullmqOptions, ", "))
		}
	}
	// The trace context goes where BullMQ's telemetry reads it: the
	// metadata its ContextManager made (bullmq-otel's getMetadata: the
	// propagator's carrier as JSON text), stored as opts.tm, which
	// Worker reads back as job.opts.telemetry.metadata and hands to
	// fromMetadata (src/classes/worker.ts, src/utils/index.ts trace).
	// A traceparent of the row wins over telemetry.metadata.
	if tp, ts, _ := TraceOptions(opts); tp != "" {
		carrier := append([]byte(`{"traceparent":`), AppendJSONString(nil, tp)...)
		if ts != "" {
			carrier = append(append(carrier, `,"tracestate":`...), AppendJSONString(nil, ts)...)
		}
		metadata = AppendJSONString(nil, string(append(carrier, '}')))
	}
	if metadata != nil {
		job.fields = append(job.fields, bullmqField{"tm", metadata})
	}
	if tenant.on() {
		job.fields = append(job.fields, bullmqField{tenant.key, AppendJSONString(nil, tenant.schema)})
	}
	return nil
}

// appendOpts appends the job's opts as JSON to b: attempts, jobId, delay
// (a delayed job), then the mapped options.
func (job *bullmqJob) appendOpts(b []byte, jid string) []byte {
	b = append(b, `{"attempts":`...)
	b = append(b, job.attempts...)
	b = append(b, `,"jobId":`...)
	b = AppendJSONString(b, jid)
	if job.delay > 0 {
		b = append(b, `,"delay":`...)
		b = strconv.AppendInt(b, job.delay, 10)
	}
	for _, f := range job.fields {
		b = append(b, ',')
		b = AppendJSONString(b, f.key)
		b = append(b, ':')
		b = append(b, f.value...)
	}
	return append(b, '}')
}
