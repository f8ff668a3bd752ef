package rabbit

import "testing"

// The orphans' counts tell the operator of a backlog found at the first
// count, of each growth with how much is new, and of an empty queue only
// when two counts in a row say so: a peek holds messages for a moment,
// and a passive declare does not count them.
func TestOrphanWatchNews(t *testing.T) {
	type step struct {
		n     int64
		news  orphanNews
		added int64
	}
	for name, steps := range map[string][]step{
		"a backlog at the first count": {{642, orphansFound, 642}, {642, orphansNoNews, 0}, {650, orphansAdded, 8}},
		"none, then some":              {{0, orphansNoNews, 0}, {5, orphansAdded, 5}, {5, orphansNoNews, 0}},
		"a peek holds them once":       {{0, orphansNoNews, 0}, {5, orphansAdded, 5}, {0, orphansNoNews, 0}, {5, orphansNoNews, 0}, {5, orphansNoNews, 0}},
		"purged":                       {{5, orphansFound, 5}, {0, orphansNoNews, 0}, {0, orphansGone, 0}, {0, orphansNoNews, 0}, {2, orphansAdded, 2}},
		"half moved, then more":        {{10, orphansFound, 10}, {4, orphansNoNews, 0}, {4, orphansNoNews, 0}, {7, orphansAdded, 3}},
		"a dip while half are moved":   {{10, orphansFound, 10}, {2, orphansNoNews, 0}, {6, orphansNoNews, 0}, {6, orphansNoNews, 0}, {9, orphansAdded, 3}},
	} {
		var w orphanWatch
		for i, s := range steps {
			if news, added := w.note(s.n); news != s.news || added != s.added {
				t.Errorf("%s: count %d (step %d) gave news %d, %d new; want %d, %d new", name, s.n, i, news, added, s.news, s.added)
			}
		}
	}
}
