package relay

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/zap"
)

// drainLoop drains every time it is woken, batch after batch until a batch
// comes back short, and retries failed batches with capped exponential
// backoff. It returns nil when ctx ends, or an error retrying cannot fix.
func (r *Relay) drainLoop(ctx context.Context, pool *pgxpool.Pool, wake <-chan struct{}) error {
	log := r.log.Named("drain")
	var batch []stagedJob
	attempt := 0
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-wake:
		}
		for ctx.Err() == nil {
			var more bool
			var err error
			batch, more, err = r.drainBatch(ctx, pool, batch, log)
			if err != nil {
				if isFatal(err) {
					return err
				}
				if ctx.Err() != nil {
					return nil
				}
				attempt++
				wait := backoff(attempt, r.cfg.MaxBackoff)
				log.Warn("batch failed, retrying", zap.Error(err), zap.Int("attempt", attempt), zap.Duration("wait", wait))
				if !sleep(ctx, wait) {
					return nil
				}
				continue
			}
			if attempt > 0 {
				log.Info("batch succeeded after retries", zap.Int("attempts", attempt+1))
				attempt = 0
			}
			if !more {
				break
			}
		}
	}
}

// drainBatch claims up to BatchSize committed rows, pushes them, deletes
// exactly the pushed ids and commits, in one transaction. more reports a
// full batch that was pushed whole: more rows are likely waiting. (Rows left
// staged would only be claimed again at once.) Any failure rolls
// the transaction back: the rows stay staged, and a push that did reach Redis
// is repeated later with the same jids (at least once).
//
// Once begun, a batch is not cut short by ctx: when ctx ends it gets
// ShutdownTimeout to finish, so a stop between push and delete does not
// cause a duplicate.
func (r *Relay) drainBatch(ctx context.Context, pool *pgxpool.Pool, buf []stagedJob, log *zap.Logger) (_ []stagedJob, more bool, err error) {
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

	start := time.Now()
	tx, err := pool.Begin(bctx)
	if err != nil {
		return buf, false, fmt.Errorf("begin: %w", err)
	}
	defer func() {
		if err != nil {
			_ = withTimeout(ctx, time.Second, tx.Rollback)
		}
	}()

	batch, err := claimBatch(bctx, tx, r.sql.claim, r.cfg.BatchSize, buf)
	if err != nil {
		return batch, false, err
	}
	if len(batch) == 0 {
		return batch, false, tx.Commit(bctx)
	}

	res, err := r.sink.push(bctx, batch, time.Now())
	if err != nil {
		return batch, false, err
	}
	for _, rj := range res.rejected {
		log.Error("job rejected, left staged", zap.Int64("id", rj.id), zap.String("reason", rj.reason))
	}
	for _, rj := range res.refused {
		log.Error("job refused by Redis, left staged", zap.Int64("id", rj.id), zap.String("reason", rj.reason))
	}
	if r.afterPush != nil {
		if err := r.afterPush(bctx); err != nil {
			return batch, false, fmt.Errorf("after push: %w", err)
		}
	}
	if len(res.pushed) > 0 {
		if _, err := tx.Exec(bctx, r.sql.delete, res.pushed); err != nil {
			return batch, false, fmt.Errorf("delete pushed: %w", err)
		}
	}
	if err := tx.Commit(bctx); err != nil {
		return batch, false, fmt.Errorf("commit: %w", err)
	}
	if ce := log.Check(zap.DebugLevel, "batch drained"); ce != nil {
		ce.Write(
			zap.Int("count", len(res.pushed)),
			zap.Int("left_staged", len(res.rejected)+len(res.refused)),
			zap.Strings("queues", r.sink.queueNames()),
			zap.Int("scheduled", len(r.sink.sched.ids)),
			zap.Duration("duration", time.Since(start)),
		)
	}
	return batch, len(batch) == r.cfg.BatchSize && len(res.pushed) == len(batch), nil
}
