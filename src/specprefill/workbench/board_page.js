// The leaderboard page's script (`board_page.render` inlines it): filters, sorting, the frontier plot.
const rows = JSON.parse(document.getElementById('board-data').textContent);
const pick = id => document.getElementById(id).value;
function shown(r) {
  return (pick('f-pair') === '' || r.pair === '' || r.pair === pick('f-pair')) && (pick('f-machine') === '' || r.machine === pick('f-machine'));
}
function filter() {
  document.querySelectorAll('tbody tr').forEach(tr => {
    const r = rows[+tr.dataset.row];
    tr.hidden = !shown(r);
  });
  document.querySelectorAll('svg.frontier').forEach(draw);
  document.querySelectorAll('p.fastest').forEach(fastest);
}
function fastest(p) {
  const pts = rows.filter(r => r.group === p.dataset.group && shown(r));
  const parts = [...new Set(pts.map(r => r.machine))].sort().map(m => {
    const ok = pts.filter(r => r.machine === m && r.verdict === 'no difference found' && r.speedup !== null);
    if (!ok.length) return `${m}: no pruned cell shows no difference from full prefill`;
    const b = ok.reduce((x, y) => (y.speedup > x.speedup ? y : x));
    return `${m}: ${b.method} at keep ${b.keep_rate}, ${b.speedup.toFixed(2)}x, accuracy ${b.accuracy.toFixed(1)} (n = ${b.n})`;
  });
  p.textContent = p.dataset.lead + (parts.join('; ') || 'no cell shown') + '.';
}
function sortBy(button) {
  const th = button.closest('th'), table = th.closest('table'), col = [...th.parentNode.children].indexOf(th);
  const key = th.dataset.key, up = th.getAttribute('aria-sort') !== 'ascending';
  table.querySelectorAll('th').forEach(h => h.setAttribute('aria-sort', 'none'));
  th.setAttribute('aria-sort', up ? 'ascending' : 'descending');
  const body = table.tBodies[0], trs = [...body.rows];
  const val = tr => { const v = rows[+tr.dataset.row][key]; return v === null || v === undefined ? null : v; };
  trs.sort((a, b) => {
    const x = val(a), y = val(b);
    if (x === null) return 1; if (y === null) return -1;
    const c = typeof x === 'number' ? x - y : String(x).localeCompare(String(y));
    return up ? c : -c;
  });
  trs.forEach(tr => body.appendChild(tr));
}
function draw(svg) {
  const NS = 'http://www.w3.org/2000/svg', W = 560, H = 300, L = 48, B = 36, T = 24, R = 150;  // T: room for a label above 100
  const pts = rows.filter(r => r.group === svg.dataset.group && shown(r) && r.speedup !== null && r.accuracy !== null);
  [...svg.querySelectorAll('.plot')].forEach(e => e.remove());
  const g = document.createElementNS(NS, 'g'); g.setAttribute('class', 'plot'); svg.appendChild(g);
  const add = (tag, attrs, text) => { const e = document.createElementNS(NS, tag);
    for (const k in attrs) e.setAttribute(k, attrs[k]); if (text !== undefined) e.textContent = text; g.appendChild(e); return e; };
  const xmax = Math.max(2, ...pts.map(p => p.speedup)) * 1.05;
  const x = v => L + (W - L - R) * v / xmax, y = v => T + (H - T - B) * (1 - v / 100);
  add('line', {x1: L, y1: y(0), x2: W - R, y2: y(0), stroke: '#555'});
  add('line', {x1: L, y1: y(0), x2: L, y2: y(100), stroke: '#555'});
  for (const v of [0, 50, 100]) add('text', {x: L - 6, y: y(v) + 4, 'text-anchor': 'end'}, v);
  for (let v = 1; v <= xmax; v += Math.max(1, Math.round(xmax / 6))) add('text', {x: x(v), y: H - B + 16, 'text-anchor': 'middle'}, v + 'x');
  add('text', {x: (L + W - R) / 2, y: H - 4, 'text-anchor': 'middle'}, 'TTFT speedup over full prefill');
  add('text', {x: 12, y: (T + H - B) / 2, transform: `rotate(-90 12 ${(T + H - B) / 2})`, 'text-anchor': 'middle'}, 'accuracy');
  // a frontier per machine: a fast machine's points never hide a slow one's (speedups are each machine's own)
  const front = pts.filter(p => !pts.some(q => q.machine === p.machine && q.speedup >= p.speedup && q.accuracy >= p.accuracy && (q.speedup > p.speedup || q.accuracy > p.accuracy)))
                   .sort((a, b) => a.speedup - b.speedup);
  for (const m of new Set(front.map(p => p.machine))) {
    const line = front.filter(p => p.machine === m);
    if (line.length > 1) add('polyline', {points: line.map(p => `${x(p.speedup)},${y(p.accuracy)}`).join(' '), fill: 'none', stroke: '#b3541e', 'stroke-dasharray': '5 4', 'stroke-width': 2});
  }
  for (const p of pts) {
    const c = add('circle', {cx: x(p.speedup), cy: y(p.accuracy), r: 4, fill: front.includes(p) ? '#b3541e' : '#0b3d91'});
    const t = document.createElementNS(NS, 'title'); t.textContent = `${p.method} at keep ${p.keep_rate}: ${p.accuracy.toFixed(1)}, ${p.speedup.toFixed(2)}x (${p.machine})`; c.appendChild(t);
  }
  front.forEach(p => add('text', {x: x(p.speedup) + 6, y: y(p.accuracy) - 6}, `${p.method}@${p.keep_rate}`));
  const many = new Set(pts.map(p => p.machine)).size > 1;
  svg.querySelector('desc').textContent = `${pts.length} points shown; on the frontier${many ? ' of each machine' : ''}: ` + (front.map(p => `${p.method} at keep ${p.keep_rate} (${p.accuracy.toFixed(1)}, ${p.speedup.toFixed(2)}x${many ? ', ' + p.machine : ''})`).join('; ') || 'none');
}
document.querySelectorAll('th button').forEach(b => b.addEventListener('click', () => sortBy(b)));
document.querySelectorAll('.filters select').forEach(s => s.addEventListener('change', filter));
filter();
