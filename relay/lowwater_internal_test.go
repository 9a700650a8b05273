package relay

import "testing"

// The mark's bookkeeping: a candidate is confirmed only by a claim whose
// snapshot's xmin reached its transaction id; a lowering moves the mark
// below a row at once and cancels the advance of a claim begun before it;
// candidates at or below the mark are dropped.
func TestLowWaterBookkeeping(t *testing.T) {
	w := &lowWater{mark: fromStart}
	want := func(mark int64) {
		t.Helper()
		if got := w.get(); got != mark {
			t.Fatalf("mark %d, want %d", got, mark)
		}
	}
	read := func(last int64, xid uint64) markRead {
		return markRead{present: true, last: last, lastOK: true, xid: xid, xidOK: true}
	}
	w.noted(read(10, 100))
	w.noted(read(20, 105))
	w.noted(markRead{present: true, last: 30, lastOK: true}) // locked nothing: no id, no candidate
	_, lowered := w.from()
	w.confirm(99, lowered) // transaction 99 may still hold an id <= 10
	want(fromStart)
	w.confirm(100, lowered)
	want(10)
	w.confirm(110, lowered)
	want(20)
	if len(w.cands) != 0 {
		t.Fatalf("candidates %v left after both were confirmed", w.cands)
	}

	// A row put back (or found by the probe) lowers the mark at once, and
	// a claim begun before that cannot advance it.
	w.noted(read(40, 120))
	_, before := w.from()
	w.lower(15)
	want(14)
	w.confirm(200, before)
	want(14)
	_, after := w.from()
	w.confirm(200, after)
	want(40)
	w.lower(50) // above the mark: no change
	want(40)

	// A candidate at or below the mark is not kept; the list is bounded.
	w.noted(read(40, 300))
	if len(w.cands) != 0 {
		t.Fatalf("a candidate at the mark was kept: %v", w.cands)
	}
	for i := range maxCandidates + 5 {
		w.noted(read(int64(100+i), uint64(400+i)))
	}
	if len(w.cands) != maxCandidates {
		t.Fatalf("%d candidates kept, want at most %d", len(w.cands), maxCandidates)
	}
	// Past the bound the newest replaces the newest kept: once every
	// transaction is over, the mark reaches the last claim's S.
	if last := w.cands[len(w.cands)-1]; last.last != 100+maxCandidates+4 {
		t.Fatalf("newest candidate kept %+v, want the last noted (S %d)", last, 100+maxCandidates+4)
	}
	_, lowered = w.from()
	w.confirm(10_000, lowered)
	want(100 + maxCandidates + 4)
	// Off: a nil mark claims from the index's start and ignores the rest.
	var off *lowWater
	off.noted(read(1, 1))
	off.confirm(1, 0)
	off.lower(1)
	if from, _ := off.from(); from != fromStart {
		t.Fatalf("a nil mark starts claims at %d", from)
	}
}
