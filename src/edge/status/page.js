// culvert edge status page: renders every Server-Sent Event (a status
// document, see the README) into the markup the server rendered first.
(function () {
  'use strict';
  var base = document.body.getAttribute('data-base');
  var live = document.getElementById('live');
  var SVG = 'http://www.w3.org/2000/svg';

  function el(tag, attrs, kids) {
    var e = tag.indexOf('svg:') === 0 ? document.createElementNS(SVG, tag.slice(4)) : document.createElement(tag);
    Object.keys(attrs || {}).forEach(function (k) { e.setAttribute(k, attrs[k]); });
    (kids || []).forEach(function (k) { e.append(k); });
    return e;
  }
  function bytes(n) {
    var units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'], i = 0;
    while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
    return i === 0 ? Math.round(n) + ' B' : n.toFixed(1) + ' ' + units[i];
  }
  function duration(s) {
    var d = Math.floor(s / 86400), h = Math.floor(s / 3600) % 24, m = Math.floor(s / 60) % 60;
    if (d > 0) return d + 'd ' + h + 'h';
    if (h > 0) return h + 'h ' + m + 'm';
    if (m > 0) return m + 'm ' + (s % 60) + 's';
    return s + 's';
  }
  function plural(n, what) { return n + ' ' + what + (n === 1 ? '' : 's'); }
  // TLS13_CHACHA20_POLY1305_SHA256 as CHACHA20-POLY1305 (page.rs: short_cipher).
  function shortCipher(s) { return s.replace(/^TLS13_/, '').replace(/_SHA(256|384)$/, '').replace(/_/g, '-'); }
  function rate(n) { return n === 0 ? '0' : n < 10 ? n.toFixed(1) : String(Math.round(n)); }
  function usage(u, fmt) {
    if (u.used == null) return ['unknown'];
    if (u.budget == null || u.budget === 0) return [fmt(u.used) + ' (no limit)'];
    var m = el('meter', { min: 0, max: u.budget, value: u.used, high: Math.floor(u.budget / 10) * 8 },
      [Math.floor(u.used * 100 / u.budget) + '%']);
    return [fmt(u.used) + ' of ' + fmt(u.budget) + ' ', m];
  }

  function renderEdge(e) {
    var items = [];
    function item(id, term, kids) { items.push(el('div', {}, [el('dt', {}, [term]), el('dd', { id: 'edge-' + id }, kids)])); }
    item('version', 'Version', [e.version + ' (tunnel protocol ' + e.protocolVersion + ')']);
    var up = [duration(e.uptimeSeconds) + ' since ' + e.startedAt];
    if (e.draining) up.push(' ', el('strong', {}, ['draining']));
    item('uptime', 'Uptime', up);
    var l = e.listeners.map(function (x) { return x.name + ' ' + x.address; });
    l.push(e.tcpListeners + ' TCP port' + (e.tcpListeners === 1 ? '' : 's'));
    item('listeners', 'Listeners', [l.join(', ')]);
    item('fds', 'Open files', usage(e.fds, String));
    item('memory', 'Memory (RSS)', usage(e.memory, bytes));
    item('store', 'Store', e.store.ok ? [e.store.engine + ': ok (' + e.store.latencyMs.toFixed(1) + ' ms)']
      : [e.store.engine + ': ', el('strong', {}, ['failing']), ': ' + (e.store.error || '')]);
    item('agents', 'Agents', [e.agentsConnected + ' connected, ' + plural(e.streamsOpen, 'stream') + ' open']);
    var acme = ['off'];
    if (e.acme) {
      acme = [e.acme.inFlight.length + ' in flight' + (e.acme.inFlight.length ? ': ' + e.acme.inFlight.join(', ') : '')];
      e.acme.errors.forEach(function (x) { acme.push(el('br'), x.hostname + ': ' + x.error); });
    }
    item('acme', 'ACME', acme);
    item('events', 'Live views', [e.events.subscribers + ' of ' + e.events.maxSubscribers + ' open']);
    document.getElementById('edge').replaceChildren.apply(document.getElementById('edge'), items);
  }

  function chart(h) {
    var w = 180, ht = 32, step = w / (Math.max(h.points, 2) - 1);
    function line(values) {
      var max = Math.max.apply(null, values.concat([1])), x0 = w - step * Math.max(values.length - 1, 0);
      return values.map(function (v, i) {
        return (x0 + step * i).toFixed(1) + ',' + (ht - 1 - (ht - 2) * v / max).toFixed(1);
      }).join(' ');
    }
    var total = h.bytesIn.map(function (v, i) { return v + h.bytesOut[i]; });
    var label = 'Traffic over the last ' + duration(h.intervalSeconds * h.points) + ': up to ' +
      Math.max.apply(null, h.requests.concat([0])) + ' requests and ' + bytes(Math.max.apply(null, total.concat([0]))) +
      ' per ' + h.intervalSeconds + ' s';
    return el('svg:svg', { 'class': 'chart', viewBox: '0 0 ' + w + ' ' + ht, width: w, height: ht, role: 'img', 'aria-label': label }, [
      el('svg:title', {}, [label]),
      el('svg:line', { 'class': 'axis', x1: 0, y1: ht, x2: w, y2: ht }),
      el('svg:polyline', { 'class': 'bytes', points: line(total) }),
      el('svg:polyline', { 'class': 'requests', points: line(h.requests) })
    ]);
  }

  var kinds = { subdomain: 'subdomain', custom: 'custom domain', tcp: 'TCP port' };
  function row(t) {
    var kind = t.kind === 'tcp' && t.name.indexOf('udp:') === 0 ? 'UDP port' : (kinds[t.kind] || t.kind);
    var sub = kind + ' · ' + t.owner;
    var labels = Object.keys(t.labels).slice(0, 8).map(function (k) { return k + '=' + t.labels[k]; });
    if (labels.length) sub += ' · ' + labels.join(', ');
    var cert = ['–'];
    if (t.certificate) {
      cert = [t.certificate.status + (t.certificate.notAfter ? ', until ' + t.certificate.notAfter : '')];
      if (t.certificate.lastError) cert.push(el('br'), el('span', { 'class': 'err' }, [t.certificate.lastError]));
    }
    var agents = [el('span', { 'class': 'count' }, [String(t.agentsConnected)])];
    if (t.agents.length) {
      agents.push(el('ul', {}, t.agents.map(function (a) {
        return el('li', {}, [a.agentId + ' · ' + a.address + ' · since ' + a.since + ' · v' + a.protocolVersion + ' · ' + shortCipher(a.cipher || '') + ' · ' + plural(a.streamsOpen, 'stream')]);
      })));
    }
    var tot = t.totals;
    function io(total, perS) {
      return [el('span', { 'class': 'total' }, [bytes(total)]), el('br'), el('span', { 'class': 'rate' }, [bytes(perS) + '/s'])];
    }
    return el('tr', { 'data-name': t.name, 'data-id': t.id }, [
      el('th', { scope: 'row', 'class': 'name' }, [el('a', { href: t.url }, [t.name]), el('div', { 'class': 'sub' }, [sub])]),
      el('td', { 'class': 'cert' }, cert),
      el('td', { 'class': 'agents', 'data-count': t.agentsConnected }, agents),
      el('td', { 'class': 'streams num' }, [String(t.streamsOpen)]),
      el('td', { 'class': 'requests num' }, [String(tot.requests)]),
      el('td', { 'class': 'rps num' }, [rate(t.rates.requests)]),
      el('td', { 'class': 'in num' }, io(tot.bytesIn, t.rates.bytesIn)),
      el('td', { 'class': 'out num' }, io(tot.bytesOut, t.rates.bytesOut)),
      el('td', { 'class': 'errors num' }, [el('span', { 'class': 'e4' }, [String(tot.errors4xx)]), ' / ',
        el('span', { 'class': 'e5' }, [String(tot.errors5xx)]), ' / ', el('span', { 'class': 'offline' }, [String(tot.offline)])]),
      el('td', { 'class': 'traffic' }, [chart(t.history)])
    ]);
  }

  function shown(s) {
    if (s.tunnelsTotal === 0) return 'No reservations yet: culvert admin domain reserve NAME, or port reserve.';
    if (s.tunnelsShown < s.tunnelsTotal) {
      return s.tunnelsShown + ' of ' + s.tunnelsTotal + ' reservations shown: those with agents, then the busiest (culvert admin domain list shows all).';
    }
    return s.tunnelsTotal + ' reservation' + (s.tunnelsTotal === 1 ? '' : 's') + '.';
  }

  function render(s) {
    renderEdge(s.edge);
    var rows = document.getElementById('rows');
    rows.replaceChildren.apply(rows, s.tunnels.map(row));
    document.getElementById('shown').textContent = shown(s);
    live.className = 'on';
    live.textContent = 'Live, updated ' + s.generatedAt;
  }

  if (!window.EventSource) return;
  var events = new EventSource(base + '/events');
  events.addEventListener('status', function (ev) { render(JSON.parse(ev.data)); });
  events.onerror = function () { live.className = ''; live.textContent = 'Reconnecting to the edge…'; };
})();
