package relay

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/stagedrain/stagedrain/relay/internal/handoff"
)

// A target turns staged rows into the Redis commands of one job system's
// format. It only adds commands to the batch's handoff.Unit: the relay runs
// them in its atomic push step (internal/handoff), with the fence check and the
// handoff record, so every target gets the same guarantees.
type target interface {
	// add builds batch into u, one op per group of rows that succeed or
	// fail together, and adds rows no worker could run to res.rejected.
	// now is the enqueue time.
	add(u *handoff.Unit, batch []stagedJob, now time.Time, res *pushResult)
}

// rejectedJob is a row that was not pushed, and why.
type rejectedJob struct {
	id     int64
	reason string
	held   bool // deferred by backpressure (backpressure.go): logged once, by the pause
}

// pushResult says which rows of a batch went to Redis.
type pushResult struct {
	pushed      []int64
	redelivered []int64       // pushed by an earlier push whose delete did not commit: not pushed again
	rejected    []rejectedJob // poison: no worker could run them, or too big; not sent
	refused     []rejectedJob // poison: sent, and Redis answered an error waiting cannot fix
	deferred    []rejectedJob // sent, and Redis answered an error waiting may fix: stay staged
	queues      []string      // the queues of the immediate jobs, for the log
	scheduled   int           // how many jobs were scheduled, for the log
	skipped     int           // how many of pushed a guard skipped (the task was there already), for the log
	field       string        // the push's field in the handoff record, "" if it pushed nothing
}

// push pushes a claimed batch to Redis in one atomic step and says what
// became of each row. Rows that an earlier push delivered, and whose delete
// did not commit, are not pushed again (res.redelivered): the batch's
// commit deletes them. An error means nothing is known to have been pushed:
// the whole batch stays staged. So is a batch that Redis refused whole, for
// reasons that waiting may fix.
func (r *Relay) push(ctx context.Context, batch []stagedJob, now time.Time) (pushResult, error) {
	pp, err := r.preparePush(ctx, batch, now)
	if err != nil || pp.u == nil {
		return pp.res, err
	}
	field, err := r.handoff.Push(ctx, pp.u)
	return r.settlePush(pp, field, err)
}

// preparedPush is a batch's push, built and not yet run (preparePush).
type preparedPush struct {
	u   *handoff.Unit // nil: nothing to run, res is the push's result
	res pushResult
}

// preparePush is push up to the handoff's step: it builds the batch's
// unit. A hot fleet's shared drain runs the units of its schemas in one
// pipeline (handoff.PushAll), then settles each (settlePush).
func (r *Relay) preparePush(ctx context.Context, batch []stagedJob, now time.Time) (preparedPush, error) {
	h := r.handoff
	var res pushResult
	if err := h.Ready(ctx, r.holder); err != nil {
		return preparedPush{}, fmt.Errorf("push batch: %w", err)
	}
	if r.hooks.beforePush != nil {
		r.hooks.beforePush(ctx)
	}
	u := h.Unit()
	for all := batch; ; {
		res, batch = pushResult{}, all
		if h.Delivering() {
			fresh := make([]stagedJob, 0, len(batch))
			for _, j := range batch {
				if h.WasDelivered(j.id) {
					res.redelivered = append(res.redelivered, j.id)
				} else {
					fresh = append(fresh, j)
				}
			}
			batch = fresh
		}
		u.Reset()
		u.MaxLen = r.cfg.MaxQueueLength
		if over, why := r.bp.memory(ctx, r); over {
			// Backpressure: Redis is nearly full. Nothing is pushed; the
			// batch's commit deletes only the rows delivered before. With
			// WAIT (mustRun), the script still runs, with no op, for the
			// replicas to acknowledge those rows' push first.
			for _, j := range batch {
				res.deferred = append(res.deferred, rejectedJob{id: j.id, reason: why, held: true})
			}
			if !h.MustRun(len(res.redelivered)) {
				return preparedPush{res: res}, nil
			}
			break // WAIT needs a single Redis: no cluster, whose loop this is
		}
		r.target.add(u, batch, now, &res)
		if len(u.Ops()) == 0 && !h.MustRun(len(res.redelivered)) {
			return preparedPush{res: res}, nil
		}
		if !h.Cluster() {
			break
		}
		// On a cluster, the slots' records are read as they are first
		// pushed to (internal/handoff/cluster.go): build again if they hold rows of the
		// batch.
		again, err := h.Claim(ctx, u, r.holder)
		if err != nil {
			return preparedPush{}, fmt.Errorf("push batch: %w", err)
		}
		if !again {
			break
		}
	}
	return preparedPush{u: u, res: res}, nil
}

// settlePush is push after the handoff's step ran pp's unit under field,
// or failed with err.
func (r *Relay) settlePush(pp preparedPush, field string, err error) (pushResult, error) {
	if err != nil {
		return pushResult{}, fmt.Errorf("push batch: %w", err)
	}
	h, u, res := r.handoff, pp.u, pp.res
	for _, op := range u.Ops() {
		switch {
		case op.IDs == nil: // bookkeeping
		case op.Err == nil:
			res.pushed = append(res.pushed, op.IDs...)
			if op.Skipped {
				res.skipped += len(op.IDs)
			}
		default:
			to := &res.refused
			if op.Over || !handoff.Permanent(op.Err) {
				to = &res.deferred
			}
			for _, id := range op.IDs {
				*to = append(*to, rejectedJob{id: id, reason: op.Err.Error(), held: op.Over})
			}
		}
	}
	r.bp.pushed(u.Ops())
	res.field = field
	held := !slices.ContainsFunc(res.deferred, func(rj rejectedJob) bool { return !rj.held })
	if len(res.pushed)+len(res.rejected)+len(res.refused)+len(res.redelivered) == 0 && !held {
		// Nothing went anywhere: wait, with backoff, rather than spin.
		h.Abandon(field)
		return pushResult{}, fmt.Errorf("push batch: Redis refused all %d jobs: %s", len(res.deferred), res.deferred[0].reason)
	}
	return res, nil
}

// stillStaged returns those of ids that are still rows of staged_jobs.
func (r *Relay) stillStaged(ctx context.Context, pool *pgxpool.Pool, ids []int64) ([]int64, error) {
	rows, err := pool.Query(ctx, r.sql.staged, ids)
	if err != nil {
		return nil, fmt.Errorf("read staged ids: %w", err)
	}
	still, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		return nil, fmt.Errorf("read staged ids: %w", err)
	}
	return still, nil
}

// checkJob reports a row no worker of any target could run (a NULL or empty
// column, job_args that is not an array: possible only where the table's
// constraints were removed), and returns its job_args JSON text, trimmed.
func checkJob(j *stagedJob) ([]byte, error) {
	switch {
	case j.bad != "":
		return nil, errors.New(j.bad)
	case j.nulls != 0:
		return nil, fmt.Errorf("%s is NULL", j.nulls)
	case j.name == "":
		return nil, errors.New("job_name is empty")
	case j.queue == "":
		return nil, errors.New("queue is empty")
	}
	args := bytes.TrimSpace(j.args)
	if len(args) == 0 || args[0] != '[' {
		return nil, errors.New("job_args is not a JSON array")
	}
	return args, nil
}

// errFenced is the handoff's refusal of a deposed leader's push: the relay
// steps down.
var errFenced = handoff.ErrFenced

// tidyEvery is how long after the last drain the drain loop tidies the
// handoff record (handoff.TidyEvery).
const tidyEvery = handoff.TidyEvery
