package relay

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/zap"
)

// drainLoop drains every time it is woken, until a batch comes back short,
// and retries after a failure with capped exponential backoff. It returns
// nil when ctx ends, or an error retrying cannot fix.
func (r *Relay) drainLoop(ctx context.Context, pool *pgxpool.Pool, wake <-chan struct{}) error {
	log := r.log.Named("drain")
	var bufs [2][]stagedJob
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-wake:
		}
		for attempt := 0; ; {
			err := r.drain(ctx, pool, &bufs, log)
			if err == nil {
				if attempt > 0 {
					log.Info("batch succeeded after retries", zap.Int("attempts", attempt+1))
				}
				break
			}
			if isFatal(err) {
				return err
			}
			if ctx.Err() != nil {
				return nil
			}
			attempt++
			wait := backoff(attempt, r.cfg.MaxBackoff)
			level := zap.WarnLevel
			if isRedisRefusal(err) {
				level = zap.ErrorLevel // credentials or DB changed: needs an operator
			}
			if ce := log.Check(level, "batch failed, retrying"); ce != nil {
				ce.Write(zap.Error(err), zap.Int("attempt", attempt), zap.Duration("wait", wait))
			}
			if !sleep(ctx, wait) {
				return nil
			}
		}
	}
}

// claimed is a batch of rows locked by its open transaction.
type claimed struct {
	tx    pgx.Tx // nil when the claim found nothing (and committed)
	jobs  []stagedJob
	start time.Time
}

// drain drains batch after batch until one comes back short (or partly
// unpushed, as its rows would only be claimed again at once). PostgreSQL
// is the bottleneck, so while one batch is pushed, deleted and committed,
// the next is already being claimed on a second connection: its claim skips
// the rows the first batch holds locked. Batches are still pushed one after
// another, in id order.
func (r *Relay) drain(ctx context.Context, pool *pgxpool.Pool, bufs *[2][]stagedJob, log *zap.Logger) error {
	cur, err := r.claim(ctx, pool, &bufs[0])
	if err != nil {
		return err
	}
	for i := 1; cur.tx != nil; i++ {
		full := len(cur.jobs) == r.cfg.BatchSize
		var next claimed
		var nextErr error
		claimedNext := make(chan struct{})
		if full {
			go func() {
				defer close(claimedNext)
				next, nextErr = r.claim(ctx, pool, &bufs[i%2])
			}()
		} else {
			close(claimedNext)
		}
		pushedAll, err := r.finish(ctx, cur, log)
		<-claimedNext
		switch {
		case err != nil:
			next.rollback(ctx)
			return err
		case nextErr != nil:
			return nextErr
		case !full || !pushedAll || ctx.Err() != nil:
			next.rollback(ctx) // claimed, not pushed: its rows stay staged
			return nil
		}
		cur = next
	}
	return nil
}

// claim begins a transaction and claims up to BatchSize committed rows into
// (*buf)[:0]. When there are none it ends the transaction and returns a
// claimed with a nil tx.
func (r *Relay) claim(ctx context.Context, pool *pgxpool.Pool, buf *[]stagedJob) (claimed, error) {
	c := claimed{start: time.Now()}
	tx, err := pool.Begin(ctx)
	if err != nil {
		return c, fmt.Errorf("begin: %w", err)
	}
	*buf, err = claimBatch(ctx, tx, r.sql.claim, r.cfg.BatchSize, *buf)
	if err != nil {
		_ = withTimeout(ctx, time.Second, tx.Rollback)
		return c, err
	}
	if len(*buf) == 0 {
		return c, tx.Commit(ctx)
	}
	c.tx, c.jobs = tx, *buf
	return c, nil
}

func (c claimed) rollback(ctx context.Context) {
	if c.tx != nil {
		_ = withTimeout(ctx, time.Second, c.tx.Rollback)
	}
}

// finish pushes a claimed batch, deletes exactly the pushed ids and commits.
// Any failure rolls the transaction back: the rows stay staged, and a push
// that did reach Redis is repeated later with the same jids (at least once).
// pushedAll reports that every row of the batch was pushed.
//
// Once claimed, a batch is not cut short by ctx: when ctx ends it gets
// ShutdownTimeout to finish, so a stop between push and delete does not
// cause a duplicate.
func (r *Relay) finish(ctx context.Context, b claimed, log *zap.Logger) (pushedAll bool, err error) {
	bctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	defer cancel()
	stop := context.AfterFunc(ctx, func() {
		t := time.NewTimer(r.cfg.ShutdownTimeout)
		defer t.Stop()
		select {
		case <-t.C:
			cancel()
		case <-bctx.Done():
		}
	})
	defer stop()
	defer func() {
		if err != nil {
			b.rollback(ctx)
		}
	}()

	res, err := r.sink.push(bctx, b.jobs, time.Now())
	if err != nil {
		return false, err
	}
	for _, rj := range res.rejected {
		log.Error("job rejected, left staged", zap.Int64("id", rj.id), zap.String("reason", rj.reason))
	}
	for _, rj := range res.refused {
		log.Error("job refused by Redis, left staged", zap.Int64("id", rj.id), zap.String("reason", rj.reason))
	}
	if r.afterPush != nil {
		if err := r.afterPush(bctx); err != nil {
			return false, fmt.Errorf("after push: %w", err)
		}
	}
	if len(res.pushed) > 0 {
		if _, err := b.tx.Exec(bctx, r.sql.delete, res.pushed); err != nil {
			return false, fmt.Errorf("delete pushed: %w", err)
		}
	}
	if err := b.tx.Commit(bctx); err != nil {
		return false, fmt.Errorf("commit: %w", err)
	}
	if ce := log.Check(zap.DebugLevel, "batch drained"); ce != nil {
		ce.Write(
			zap.Int("count", len(res.pushed)),
			zap.Int("left_staged", len(res.rejected)+len(res.refused)),
			zap.Strings("queues", res.queues),
			zap.Int("scheduled", res.scheduled),
			zap.Duration("duration", time.Since(b.start)),
		)
	}
	return len(res.pushed) == len(b.jobs), nil
}
